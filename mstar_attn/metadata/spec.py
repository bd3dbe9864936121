"""What the model and the KV cache look like: fixed for the life of an engine."""

from __future__ import annotations

import enum
import math

import attrs
import numpy as np
import torch

from mstar_attn.metadata._arrays import INT32_MAX, positive_int
from mstar_attn.metadata.backends import AUTO, AUTO_DEFAULT, AUTO_MLA, BACKENDS, CASCADE_BACKENDS, FP8, FP8_MATH_BACKENDS
from mstar_attn.metadata.errors import PlanError

MLA_BACKEND = AUTO_MLA  # (kept name) what backend="auto" serves latent attention with
XQA_PAGE_SIZES = (16, 32, 64, 128)  # the page sizes FlashInfer's XQA decode kernel compiles for (AttentionSpec.fp8_math)
CASCADE_MODES = ("off", "auto", "always")  # AttentionSpec.cascade

__all__ = ["AttentionSpec", "Kind", "LayerGroup", "PlanError"]


class Kind(enum.Enum):
    CAUSAL = "causal"  # full causal attention, queries at the end of the sequence
    WINDOW = "window"  # causal, each query sees only the last `window` keys (itself included)
    NONCAUSAL = "noncausal"  # every query sees every key of its request
    CROSS = "cross"  # encoder-decoder cross attention: every query sees all of its request's encoder K/V,
    # which sit on the group's own pages with lengths of their own (GroupPages.kv_lens)


def _kind(value) -> Kind:
    try:
        return Kind(value)
    except ValueError:
        raise PlanError(f"LayerGroup.kind: expected one of {[k.value for k in Kind]}, got {value!r}") from None


def _positive(inst, attribute, value):
    positive_int(attribute.name, value)


@attrs.frozen
class LayerGroup:
    """Layers that share one attention pattern (and therefore one kernel plan).

    `window` is W for Kind.WINDOW: a query at position p sees keys p-W+1 .. p
    (FlashInfer's window_left = W - 1, FlashAttention's window_size = (W - 1, 0)).

    own_pages: the group's layers keep their own page list (StepBatch.group_pages), so a window
    group may hold only the pages its window still sees and the engine frees the rest (a hybrid
    model's sliding-window layers). Its page ids index the caches of the group's layers, a space of
    their own: they never conflict with the shared list's pages. False: the group reads the
    batch's shared list (page_indptr / page_indices), as every group of a plain model does.
    Kind.CROSS groups always keep their own list (own_pages is True for them): the encoder's K/V,
    written once, read non-causally by every decoder query of the request.

    sinks: the group's layers have attention sinks (gpt-oss): a learned logit s_h per query head joins
    every softmax denominator, out = sum_j exp(l_j) v_j / (sum_j exp(l_j) + exp(s_h)), l_j the scaled
    (and soft-capped) logits; no value goes with it. Each layer has its own sinks, a float32 tensor
    [num_qo_heads] passed at run time (`run(..., sinks=)`, `Attention(..., sinks=)`). Only backends whose
    Capabilities declare sinks serve such a spec (PlanError at construction for the others).
    """

    kind: Kind = attrs.field(default=Kind.CAUSAL, converter=_kind)
    window: int | None = None
    own_pages: bool = False
    sinks: bool = False

    def __attrs_post_init__(self):
        if (self.kind is Kind.WINDOW) != (self.window is not None):
            raise PlanError(f"LayerGroup.window is set iff kind is 'window' (kind={self.kind.value}, window={self.window})")
        if self.window is not None:
            object.__setattr__(self, "window", positive_int("LayerGroup.window", self.window))
        if not isinstance(self.own_pages, (bool, np.bool_)):
            raise PlanError(f"LayerGroup.own_pages: expected True or False, got {self.own_pages!r}")
        object.__setattr__(self, "own_pages", bool(self.own_pages) or self.kind is Kind.CROSS)
        if not isinstance(self.sinks, (bool, np.bool_)):
            raise PlanError(f"LayerGroup.sinks: expected True or False, got {self.sinks!r}")
        object.__setattr__(self, "sinks", bool(self.sinks))

    @property
    def causal(self) -> bool:
        return self.kind is not Kind.NONCAUSAL and self.kind is not Kind.CROSS

    @property
    def cross(self) -> bool:
        return self.kind is Kind.CROSS

    @property
    def window_left(self) -> int:
        """Keys left of the query a query may see; -1 means unbounded (FlashInfer's convention)."""
        return -1 if self.window is None else self.window - 1


def _sequence(name: str, value) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise PlanError(f"{name}: expected a sequence, got {value!r}")
    return tuple(value)


def _groups(value) -> tuple:
    groups = _sequence("groups", value)
    for i, g in enumerate(groups):
        if not isinstance(g, LayerGroup):
            raise PlanError(f"groups[{i}]: expected a LayerGroup, got {type(g).__name__}")
    return groups


def _layer_groups(value) -> tuple:
    out = _sequence("layer_groups", value)
    for i, g in enumerate(out):
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)):
            raise PlanError(f"layer_groups[{i}]: expected a group index, got {g!r}")
    return tuple(int(g) for g in out)


@attrs.frozen
class AttentionSpec:
    """Model and cache shape. `layer_groups[i]` is the index into `groups` of layer i.

    dtype is the dtype of q, k, v and (unless kv_dtype says otherwise) the KV cache. kv_dtype: an FP8
    dtype keeps the cache in FP8 with per-tensor scales (PagedKVCache.k_scale / v_scale): write_kv
    quantizes, the kernels dequantize. mla_rope_dim > 0 makes the layers latent attention (MLA, the
    absorbed form DeepSeek V2/V3 decode with): one KV head (num_kv_heads 1) whose cache holds the
    compressed latent c_kv (head_dim, e.g. 512) as "K" and the shared RoPE key k_pe (mla_rope_dim, e.g.
    64) as "V"; q is [T, heads, head_dim + mla_rope_dim] (q_nope absorbed through W_UK, then q_pe),
    logits = q_nope . c_kv + q_pe . k_pe, and the output [T, heads, head_dim] is softmax . c_kv (apply
    W_UV after). Pass sm_scale (MLA's is 1 / sqrt(qk_nope_head_dim + rope dim), not head_dim's).
    fp8_math (with kv_dtype float8_e4m3fn, FlashInfer backend, Hopper): decode steps (one query token
    per request, draft-round steps included) run FlashInfer's XQA FP8 kernel, which rounds the queries
    and the softmax probabilities to e4m3 for FP8 tensor-core math: 1.8x bf16 decode at B 64 / 4k
    tokens against 1.44x for bf16 math over the same cache (benchmarks/results/fp8_kernels_h100.md), at
    a larger error (docs/fp8_mla.md). Other steps keep bf16 math. Page sizes 16, 32, 64, 128; no
    soft cap; GQA ratio <= 128. Queries are rounded to e4m3 unscaled: magnitudes above 448 saturate and
    below 2^-6 lose relative precision (fine for the usual O(1) post-RoPE queries). A decode request
    must fit the pool's max_pages_per_request (XQA reads a dense page table). The reference backend computes exactly (the oracle of both).
    cascade: "auto" or "always" makes build_plan look for requests whose page lists start with the same
    whole cached pages (metadata/cascade.py) in decode and verify steps of StepBatch plans, and run them
    in two levels merged by log-sum-exp (each group's shared pages once, each request's own suffix):
    "auto" in decode steps where the cost model (cascade.CostModel) estimates it faster than the flat
    path, "always" wherever a prefix is shared (decode and verify). Served by the flashinfer and reference backends ("auto" backend:
    a cascade step goes to flashinfer), in the full causal and non-causal layer groups that read the
    shared list (`cascade_groups`); window and own-page groups read flat in the same step. BF16/FP16
    caches, standard attention (no FP8 cache, no MLA).
    sm_scale defaults to head_dim ** -0.5;
    soft_cap = 0 disables logit soft-capping (otherwise logits become cap * tanh(logits / cap)).
    num_pages: the engine's page ids are 0 .. num_pages - 1. The cache holds one page more,
    `scratch_page` (= num_pages): padding rows of bucketed steps and graph capture write and read
    it, it belongs to no request, and build_plan rejects a step that lists it.
    """

    num_qo_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    page_size: int = attrs.field(validator=_positive)
    num_pages: int = attrs.field(validator=_positive)
    dtype: torch.dtype = torch.bfloat16
    sm_scale: float = attrs.field()
    soft_cap: float = 0.0
    groups: tuple[LayerGroup, ...] = attrs.field(default=(LayerGroup(),), converter=_groups)
    layer_groups: tuple[int, ...] = attrs.field(default=(0,), converter=_layer_groups)
    backend: str = "flashinfer"  # a BACKENDS name, or "auto": build_plan picks per step
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype: None (= dtype), or an FP8 dtype (backends.FP8)
    mla_rope_dim: int = 0  # > 0: latent attention (MLA); see the class doc
    fp8_math: bool = False  # FP8 cache: decode steps compute in FP8 (queries and probabilities in e4m3); see the class doc
    cascade: str = "off"  # shared prefixes read once per step: "off", "auto" (where the cost model says it wins), "always"
    cache_shape: tuple[int, int, int, int] = attrs.field(init=False, eq=False, repr=False)
    """Shape of each layer's K (and V): [num_pages + 1 (the scratch page), page_size, kv_heads, head_dim]."""
    v_cache_shape: tuple[int, int, int, int] = attrs.field(init=False, eq=False, repr=False)
    """Shape of each layer's V: cache_shape, or for MLA [num_pages + 1, page_size, 1, mla_rope_dim] (k_pe)."""
    own_page_groups: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    """Indices of the groups that keep their own page list (LayerGroup.own_pages; cross groups among them)."""
    has_cross: bool = attrs.field(init=False, eq=False, repr=False)
    """Whether some group is cross attention (Kind.CROSS)."""
    has_sinks: bool = attrs.field(init=False, eq=False, repr=False)
    """Whether some group has attention sinks (LayerGroup.sinks)."""

    @sm_scale.default
    def _default_scale(self):  # a bad head_dim is reported by its validator, not here
        d = self.head_dim
        return float(d) ** -0.5 if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 else 1.0

    def __attrs_post_init__(self):
        if not isinstance(self.dtype, torch.dtype):
            raise PlanError(f"spec.dtype: expected a torch.dtype, got {self.dtype!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise PlanError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_pages >= INT32_MAX:
            raise PlanError(f"num_pages: page ids (and the scratch page, num_pages) must fit int32, got {self.num_pages}")
        for name in ("sm_scale", "soft_cap"):
            value = getattr(self, name)
            try:
                finite = not isinstance(value, bool) and math.isfinite(float(value))
            except (TypeError, ValueError, OverflowError):
                finite = False
            if not finite or not isinstance(value, (int, float, np.floating, np.integer)):
                raise PlanError(f"spec.{name}: expected a finite number, got {str(value)[:40]}")
        if self.sm_scale <= 0:
            raise PlanError(f"sm_scale must be positive, got {self.sm_scale}")
        if self.soft_cap < 0:
            raise PlanError(f"soft_cap must be >= 0 (0 disables it), got {self.soft_cap}")
        if not self.groups:
            raise PlanError("groups must name at least one LayerGroup")
        object.__setattr__(self, "has_sinks", any(group.sinks for group in self.groups))
        bad = [i for i, g in enumerate(self.layer_groups) if not 0 <= g < len(self.groups)]
        if bad:
            raise PlanError(f"layer_groups[{bad[0]}] = {self.layer_groups[bad[0]]} is not a group index (0..{len(self.groups) - 1})")
        if not isinstance(self.backend, str) or (self.backend != AUTO and self.backend not in BACKENDS):
            raise PlanError(f"spec.backend: unknown backend {self.backend!r} (known: {sorted(BACKENDS)} or {AUTO!r})")
        if self.kv_dtype is not None and not isinstance(self.kv_dtype, torch.dtype):
            raise PlanError(f"spec.kv_dtype: expected a torch.dtype or None, got {self.kv_dtype!r}")
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", None)  # (the same spec as without it: equal, and the same pools)
        if self.kv_dtype is not None and self.kv_dtype not in FP8:
            raise PlanError(f"spec.kv_dtype: the KV cache keeps the query dtype ({self.dtype}) or an FP8 dtype "
                            f"({', '.join(sorted(map(str, FP8)))}), not {self.kv_dtype!r}")
        r = self.mla_rope_dim
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
            raise PlanError(f"spec.mla_rope_dim: expected an integer >= 0 (0: not MLA), got {r!r}")
        if r and self.num_kv_heads != 1:
            raise PlanError(f"spec.num_kv_heads: latent attention (mla_rope_dim {r}) has one KV head, got {self.num_kv_heads}")
        if not isinstance(self.fp8_math, bool):
            raise PlanError(f"spec.fp8_math: expected a bool, got {self.fp8_math!r}")
        if self.fp8_math:
            why = (self.kv_dtype != torch.float8_e4m3fn and f"kv_dtype float8_e4m3fn, not {self.kv_dtype}"
                   or self.page_size not in XQA_PAGE_SIZES and f"a page size in {XQA_PAGE_SIZES}, not {self.page_size}"
                   or self.soft_cap and "no logit soft cap" or self.mla_rope_dim and "standard (not latent) attention"
                   or self.num_qo_heads // self.num_kv_heads > 128 and "a GQA ratio of at most 128"
                   or self.has_sinks and "no attention sinks (XQA returns no log-sum-exp)"
                   or self.backend not in (*FP8_MATH_BACKENDS, AUTO)
                   and f"backend {' or '.join(FP8_MATH_BACKENDS)}, not {self.backend!r}")
            if why:
                raise PlanError(f"spec.fp8_math: FP8 decode math (FlashInfer XQA) needs {why}")
        if self.cascade not in CASCADE_MODES:
            raise PlanError(f"spec.cascade: expected one of {CASCADE_MODES}, got {self.cascade!r}")
        if self.cascade != "off":
            why = (self.backend not in (*CASCADE_BACKENDS, AUTO) and f"backend {', '.join(CASCADE_BACKENDS)} or auto, not {self.backend!r}"
                   or r and "standard (not latent) attention" or self.kv_dtype is not None and f"a {self.dtype} cache, not {self.kv_dtype}"
                   or not any(g.kind in (Kind.CAUSAL, Kind.NONCAUSAL) and not g.own_pages for g in self.groups)
                   and "a full causal or non-causal layer group reading the shared page list")
            if why:
                raise PlanError(f"spec.cascade: shared-prefix (cascade) attention needs {why}")
        name = self.backend if self.backend != AUTO else AUTO_MLA if r else AUTO_DEFAULT  # auto's fallbacks
        if name == AUTO_MLA:  # what FlashInfer's MLA kernels cannot express (the reference serves all of it)
            why = (self.soft_cap and "no logit soft cap" or r % 64 and f"mla_rope_dim a multiple of 64, not {r}"
                   or (self.num_qo_heads % 64 and 64 % self.num_qo_heads) and
                   f"a head count dividing 64 or a multiple of 64, not {self.num_qo_heads}"
                   or any(g.kind not in (Kind.CAUSAL, Kind.NONCAUSAL) or g.own_pages for g in self.groups)
                   and "causal or non-causal groups sharing one page list")
            if why:
                raise PlanError(f"spec: backend {AUTO_MLA!r} (FlashInfer MLA) needs {why}; the reference backend serves it")
        BACKENDS[name].check(self, name)
        shape = (int(self.num_pages) + 1, int(self.page_size), int(self.num_kv_heads), int(self.head_dim))
        object.__setattr__(self, "cache_shape", shape)
        object.__setattr__(self, "v_cache_shape", shape[:3] + (int(r),) if r else shape)
        object.__setattr__(self, "own_page_groups", tuple(g for g, group in enumerate(self.groups) if group.own_pages))
        object.__setattr__(self, "has_cross", any(group.cross for group in self.groups))

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype of the KV cache: kv_dtype, or dtype when it is None."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def mla(self) -> bool:
        """Latent attention (mla_rope_dim > 0): see the class doc."""
        return self.mla_rope_dim > 0

    @property
    def fp8_kv(self) -> bool:
        """Whether the KV cache is FP8 (kv_dtype one of backends.FP8)."""
        return self.kv_cache_dtype in FP8

    @property
    def cascade_groups(self) -> tuple[int, ...]:
        """The layer groups a cascade step runs in two levels (full causal / non-causal, shared list); none when off."""
        if self.cascade == "off":
            return ()
        return tuple(i for i, g in enumerate(self.groups) if g.kind in (Kind.CAUSAL, Kind.NONCAUSAL) and not g.own_pages)

    @property
    def gqa_group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def scratch_page(self) -> int:
        """The cache page no request owns (see the class doc)."""
        return self.num_pages

    def group_of(self, layer: int) -> int:
        """The layer group of model layer `layer`: layer_groups[layer], or for a spec of one layer group
        (the default groups and layer_groups) that group for every layer; PlanError past layer_groups
        otherwise (a spec of several groups names every layer's)."""
        lg = self.layer_groups
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise PlanError(f"layer: expected a layer index >= 0, got {layer!r}")
        if len(lg) == 1 and len(self.groups) == 1:
            return lg[0]
        if layer >= len(lg):
            raise PlanError(f"layer: {layer} is past spec.layer_groups, which names {len(lg)} layers (0..{len(lg) - 1})")
        return lg[layer]

