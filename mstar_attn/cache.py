"""The paged KV cache: separate K and V tensors per layer, NHD layout.

Separate K and V (rather than one [pages, 2, ...] tensor) because both FlashInfer (a (k, v)
tuple) and FlashAttention (k_cache, v_cache) read them as they are, with no strided view.
"""

from __future__ import annotations

import math

import attrs
import torch

from mstar_attn.metadata.backends import FP8
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.spec import AttentionSpec

_CHECK_CHUNK_BYTES = 64 << 20  # the finiteness check reads the cache in chunks of this size


def _tensor(name: str):
    def check(inst, attribute, value):
        if not isinstance(value, torch.Tensor):
            raise PlanError(f"PagedKVCache.{name}: expected a tensor, got {type(value).__name__}")
        if value.dim() != 4 or not value.is_contiguous():
            raise PlanError(f"PagedKVCache.{name}: expected a contiguous [pages, page_size, kv_heads, head_dim] tensor, "
                            f"got shape {tuple(value.shape)}{'' if value.is_contiguous() else ' (not contiguous)'}")
    return attrs.field(validator=check)


def default_device(device: torch.device | str | None = None) -> torch.device | str:
    """`device`, or when None the one a pool defaults to: CUDA when torch sees a device, else the CPU."""
    if device is not None:
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pool_device(device: torch.device | str | None) -> torch.device:
    """The torch device a pool lives on: `device` (None: default_device), CUDA with its index fixed now (the
    current device for "cuda"); PlanError for what is not a torch device, or CUDA where torch sees none."""
    device = default_device(device)
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise PlanError(f"device: {device!r} is not a torch device ({e})") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"device: {device!r}, but this torch ({torch.__version__}) sees no CUDA device; a CPU pool "
                        "is device='cpu' (with backend='reference')")
    return torch.device("cuda", torch.cuda.current_device()) if out.type == "cuda" and out.index is None else out


@attrs.frozen
class PagedKVCache:
    """k, v: [pages, page_size, num_kv_heads, head_dim], one dtype, one device. (A latent-attention
    cache, AttentionSpec.mla_rope_dim > 0: k is c_kv [pages, page_size, 1, head_dim], v is k_pe
    [pages, page_size, 1, mla_rope_dim].)

    Token at slot s (= page * page_size + offset) lives at k.view(-1, H, D)[s]. A cache for an
    AttentionSpec has spec.cache_shape: the engine's num_pages pages plus the scratch page.
    finite: every element is known finite (zero-filled by `allocate`, or checked by
    `from_tensors`). Backends whose kernel reads whole pages, rows past each sequence's length
    included ("flash_attn"), refuse a cache not known finite: an uninitialised row times a zero
    probability is still NaN.
    k_scale, v_scale: an FP8 cache's per-tensor scales (host floats, so captured graphs stay valid:
    they are part of the frozen cache): stored value = clamp(x / scale) in FP8, read back as value *
    scale. 1.0 for other dtypes. Calibrate them so |K| / k_scale and |V| / v_scale stay within the
    FP8 range (448 for e4m3): write_kv saturates what lies beyond.
    group: the layer group whose layers this cache serves, or None (not tagged). A tagged cache is
    refused by write_kv / run calls naming another group: with own page lists (LayerGroup.own_pages)
    the groups' page ids are separate spaces, so a cache written through another group's slots
    would overwrite pages another request holds.
    """

    k: torch.Tensor = _tensor("k")
    v: torch.Tensor = _tensor("v")
    finite: bool = attrs.field(default=False, kw_only=True)
    group: int | None = attrs.field(default=None, kw_only=True)
    k_scale: float = attrs.field(default=1.0, kw_only=True)
    v_scale: float = attrs.field(default=1.0, kw_only=True)

    def __attrs_post_init__(self):
        k, v = self.k, self.v  # (an MLA cache's V, the RoPE keys, has its own last dimension)
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
            raise PlanError(f"PagedKVCache: k and v differ: {tuple(k.shape)} {k.dtype} {k.device} vs "
                            f"{tuple(v.shape)} {v.dtype} {v.device}")
        g = self.group
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 0):
            raise PlanError(f"PagedKVCache.group: expected a layer-group index or None, got {g!r}")
        for name in ("k_scale", "v_scale"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 2.0**-100 <= x <= 2.0**100:
                raise PlanError(f"PagedKVCache.{name}: expected a positive number in 2^-100 .. 2^100 (its inverse and "
                                f"products must stay finite in float32), got {x!r}")
            if x != 1.0 and k.dtype not in FP8:
                raise PlanError(f"PagedKVCache.{name}: scales are for FP8 caches; this one is {k.dtype}")
            object.__setattr__(self, name, float(x))

    @classmethod
    def allocate(cls, spec: AttentionSpec, device: torch.device | str = "cpu", group: int | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> PagedKVCache:
        """Zero-filled, spec.cache_shape, spec.kv_cache_dtype: finite from the start. group, scales: see the class doc."""
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"PagedKVCache.allocate: device {device!r}, but this torch ({torch.__version__}) sees no CUDA "
                            "device; allocate on 'cpu' (the reference backend serves it)")
        return cls(torch.zeros(spec.cache_shape, dtype=spec.kv_cache_dtype, device=device),
                   torch.zeros(spec.v_cache_shape, dtype=spec.kv_cache_dtype, device=device), finite=True, group=group,
                   k_scale=k_scale, v_scale=v_scale)

    @classmethod
    def from_tensors(cls, k: torch.Tensor, v: torch.Tensor, group: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> PagedKVCache:
        """Wrap tensors the engine allocated, after checking every element is finite (reads the
        whole cache once, in chunks, with one device sync; PlanError if any is not)."""
        cache = cls(k, v, group=group, k_scale=k_scale, v_scale=v_scale)
        ok = torch.ones((), dtype=torch.bool, device=k.device)
        for t in (k, v):
            pages = max(1, _CHECK_CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
            for i in range(0, t.shape[0], pages):
                chunk = t[i : i + pages]
                ok &= torch.isfinite(chunk.half() if chunk.dtype in FP8 else chunk).all()
        if not ok.item():
            raise PlanError("PagedKVCache.from_tensors: the cache holds non-finite values (uninitialised memory?); "
                            "zero it first or use PagedKVCache.allocate")
        return attrs.evolve(cache, finite=True)

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K rows [n, H, k.shape[-1]] and V rows [n, H, v.shape[-1]] (any float dtype, the cache's
        device) into flat slots [n] int64, in place, capturable. Cast to the cache dtype, or for FP8
        scaled by 1 / scale, saturated to the FP8 range (an infinity becomes NaN, as NaN stays NaN)
        and cast, written as bytes (CPU torch has no FP8 index_copy_). The backends' write_kv check
        the arguments first; this does not."""
        k_flat, v_flat = self.flat()
        for flat, x, scale in ((k_flat, k, self.k_scale), (v_flat, v, self.v_scale)):
            if flat.dtype in FP8:
                top = torch.finfo(flat.dtype).max
                x = x.float() * (1.0 / scale)
                x = torch.where(x.isinf(), torch.nan, x).clamp_(-top, top).to(flat.dtype)
                flat.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
            else:
                flat.index_copy_(0, slots, x.to(flat.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at flat slots src [n] to slots dst [n] (int64, the cache's device), in place and
        capturable: every source is read before any destination is written, so the moves may overlap. The
        bytes move as stored (FP8 included). Unchecked, like `store` (tree.accepted_moves gives checked ones)."""
        for flat in self.flat():
            raw = flat.view(torch.uint8) if flat.dtype in FP8 else flat
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def read(self, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` [n] (int64, the cache's device) as [n * page_size, H, k's / v's last dim]
        in `dtype`, dequantized for FP8 (value * scale). Unchecked, like `store`."""
        k, v = (t[pages].flatten(0, 1).to(dtype) for t in (self.k, self.v))
        if self.k.dtype in FP8:
            k, v = k * self.k_scale, v * self.v_scale
        return k, v

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [pages * page_size, H, k's / v's last dim] views indexed by slot."""
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])

    def check(self, spec: AttentionSpec, where: str, group: int | None = None) -> None:
        """PlanError unless this cache fits `spec`: dtype, page_size, heads, head_dim, and a page
        for every page id plus the scratch page; and, when both are known, it serves layer group
        `group`. Host-side metadata only."""
        if self.group is not None and group is not None and self.group != group:
            raise PlanError(f"{where}: the cache serves layer group {self.group}, the call names group {group}")
        k = self.k
        if (k.dtype != spec.kv_cache_dtype or k.shape[1:] != spec.cache_shape[1:] or k.shape[0] < spec.cache_shape[0]
                or self.v.shape[1:] != spec.v_cache_shape[1:]):
            want = spec.cache_shape
            why = (k.dtype != spec.kv_cache_dtype and f"dtype {k.dtype}, the spec's KV dtype is {spec.kv_cache_dtype}"
                   or k.ndim != 4 and f"{k.ndim} dims, not 4 (pages, page_size, kv_heads, head_dim)"
                   or k.shape[1] != want[1] and f"page size {k.shape[1]}, the spec's is {want[1]}"
                   or k.shape[2] != want[2] and f"{k.shape[2]} KV heads, the spec has {want[2]}"
                   or k.shape[3] != want[3] and f"head_dim {k.shape[3]}, the spec's is {want[3]}"
                   or k.shape[0] < want[0] and f"{k.shape[0]} pages, fewer than num_pages + 1 = {want[0]} (the last page "
                                               "is the scratch page)"
                   or f"v is {tuple(self.v.shape)}, the spec needs {spec.v_cache_shape}")
            raise PlanError(f"{where}: cache is {tuple(k.shape)} {k.dtype}, the spec needs {want} {spec.kv_cache_dtype}: "
                            f"{why} (PagedKVCache.allocate(spec) makes one)")
