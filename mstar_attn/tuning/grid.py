"""The grid: the step shapes the benchmark measures, their random batches and their cost. Pure host code."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np

from mstar_attn.metadata.backends import BACKENDS
from mstar_attn.metadata.batch import StepBatch

TOL = 2e-2  # norm-relative error vs the float32 reference; bf16 kernels land near 4e-3
FLUSH_BYTES = 256 << 20  # > 5x the H100's 50 MB L2
GRID_BACKENDS = tuple(n for n in BACKENDS if n != "reference")  # the oracle is not a contender
_DTYPES = ("bfloat16", "float16")


def _jitter(rng: np.random.Generator, x: int, n: int) -> np.ndarray:
    """n values in [x - x // 8, x], the first exactly x: the nominal value is the maximum."""
    out = (x - rng.integers(0, x // 8 + 1, n)).astype(np.int64)
    out[0] = x
    return out


@attrs.frozen
class Shape:
    """One grid point. kind: the Mode build_plan must give ("decode", "prefill", "verify",
    "extend", "mixed"). batch requests get q_len new tokens after `prefix` cached ones (decode:
    q_len 1, context prefix + 1). mixed: `batch` prefill chunks beside `decodes` decode requests,
    all over prefixes near `prefix`. Lengths vary by up to 1/8 below nominal (decode and verify
    prefixes, prefill / extend / mixed q_lens), as a real batch does; verify keeps one q_len."""

    kind: str
    batch: int
    q_len: int
    prefix: int
    heads: tuple[int, int] = attrs.field(default=(32, 8), converter=tuple)
    head_dim: int = 128
    page_size: int = 16
    decodes: int = 0
    dtype: str = "bfloat16"

    def __attrs_post_init__(self):
        ok = {
            "decode": self.q_len == 1 and self.prefix >= 0,
            "prefill": self.q_len >= 1 and self.prefix == 0,
            "verify": self.q_len >= 2 and self.prefix >= 1,
            "extend": self.q_len >= 2 and self.prefix >= 1 and self.batch >= 2,
            "mixed": self.q_len >= 2 and self.decodes >= 1,
        }.get(self.kind)
        if not ok or self.batch < 1 or self.dtype not in _DTYPES:
            raise ValueError(f"Shape: inconsistent {self!r}")

    @property
    def name(self) -> str:
        h = f"h{self.heads[0]}/{self.heads[1]} d{self.head_dim} p{self.page_size}"
        if self.kind == "decode":
            return f"decode B={self.batch} ctx={self.prefix + 1} {h}"
        if self.kind == "prefill":
            return f"prefill B={self.batch} q={self.q_len} {h}"
        extra = f"+{self.decodes}dec " if self.decodes else ""
        return f"{self.kind} B={self.batch} q={self.q_len} {extra}prefix={self.prefix} {h}"

    @property
    def group(self) -> tuple:
        """Shapes of one group share a KV cache and pools: heads, head_dim, page_size, dtype."""
        return (*self.heads, self.head_dim, self.page_size, self.dtype)

    def lens(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(q_lens, kv_lens) of one random batch of this shape."""
        n = self.batch
        if self.kind == "decode":
            q, prefix = np.ones(n, np.int64), _jitter(rng, self.prefix, n)
        elif self.kind == "prefill":
            q, prefix = _jitter(rng, self.q_len, n), np.zeros(n, np.int64)
        elif self.kind == "verify":
            q, prefix = np.full(n, self.q_len, np.int64), _jitter(rng, self.prefix, n)
        else:  # extend / mixed
            q, prefix = _jitter(rng, self.q_len, n), _jitter(rng, self.prefix, n)
            q[0], q[-1] = self.q_len, max(self.q_len - max(self.q_len // 8, 1), 1)  # not uniform: extend, not verify
            if self.decodes:
                q = np.concatenate([q, np.ones(self.decodes, np.int64)])
                prefix = np.concatenate([prefix, _jitter(rng, self.prefix, self.decodes)])
        return q, q + prefix

    @property
    def max_requests(self) -> int:
        return self.batch + self.decodes

    @property
    def max_tokens(self) -> int:
        return self.batch * self.q_len + self.decodes

    @property
    def max_pages_per_request(self) -> int:
        return -(-(self.prefix + self.q_len) // self.page_size)

    @property
    def max_pages(self) -> int:
        return self.max_requests * self.max_pages_per_request


def make_batch(shape: Shape, num_pages: int, seed: int = 0) -> StepBatch:
    """A random batch of `shape` over distinct random pages of 1..num_pages-1."""
    rng = np.random.default_rng(seed)
    q, kv = shape.lens(rng)
    need = -(-kv // shape.page_size)
    indptr = np.zeros(q.shape[0] + 1, np.int64)
    np.cumsum(need, out=indptr[1:])
    if indptr[-1] > num_pages - 1:
        raise ValueError(f"make_batch: {shape.name} needs {indptr[-1]} pages, only {num_pages - 1} are drawn from")
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32))[: indptr[-1]]
    return StepBatch.from_csr(q, kv, indptr, pages, shape.page_size)


DEFAULT_HEADS = ((32, 8), (16, 2))


def default_grid(heads=DEFAULT_HEADS, head_dim: int = 128) -> list[Shape]:
    """The full grid, bf16, one head_dim (default 128: one FlashInfer JIT family): per (qo, kv)
    heads pair (default 32/8, Llama-3-8B, and 16/2, Llama-3-70B at tensor-parallel 4: both GQA
    ratios use FlashInfer's tensor-core decode, so no extra JIT module; 32/32 adds FlashInfer's
    CUDA-core decode, ~25 s of JIT) decode at 512 / 4k / 16k tokens of context, prefill, verify,
    extend and mixed steps, all at page size 16; then a few shapes of the first pair at page size
    128 (FA4's TMA page loader on H100). Each shape falls in its own table bucket
    (tests/test_tuning.py checks it)."""
    shapes = []
    for h in heads:
        kw = dict(heads=h, head_dim=head_dim)
        for ctx, batches in ((512, (1, 8, 32, 128)), (4096, (1, 8, 32, 128)), (16384, (1, 8, 32))):
            shapes += [Shape("decode", b, 1, ctx - 1, **kw) for b in batches]
        shapes += [Shape("prefill", b, q, 0, **kw) for b, q in ((1, 512), (1, 4096), (8, 512), (8, 2048), (32, 128))]
        shapes += [Shape("verify", 32, 4, 2048, **kw), Shape("extend", 4, 512, 2048, **kw),
                   Shape("mixed", 4, 512, 2048, decodes=60, **kw)]
    kw = dict(heads=heads[0], head_dim=head_dim, page_size=128)
    shapes += [Shape("decode", 32, 1, 4095, **kw), Shape("prefill", 8, 2048, 0, **kw),
               Shape("verify", 32, 4, 2048, **kw), Shape("extend", 4, 512, 2048, **kw)]
    return shapes


def quick_grid(heads=DEFAULT_HEADS, head_dim: int = 128) -> list[Shape]:
    """Three small shapes of the first heads pair, for smoke tests (JIT still dominates a cold run)."""
    kw = dict(heads=heads[0], head_dim=head_dim)
    return [Shape("decode", 8, 1, 511, **kw), Shape("prefill", 2, 256, 0, **kw), Shape("verify", 8, 4, 512, **kw)]


def _groups(shapes: Iterable[Shape]) -> dict[tuple, list[Shape]]:
    out: dict[tuple, list[Shape]] = {}
    for s in shapes:
        out.setdefault(s.group, []).append(s)
    return out


def _cost(q: np.ndarray, kv: np.ndarray, hq: int, hkv: int, d: int, elem: int = 2) -> tuple[int, int]:
    """(bytes, FLOPs) of one layer's write_kv + causal attention over a step (see module doc)."""
    q, kv = q.astype(np.int64), kv.astype(np.int64)
    T = int(q.sum())
    kv_read = int(kv.sum()) * hkv * d * elem * 2
    q_out = 2 * T * hq * d * elem
    write = 2 * T * hkv * d * elem * 2  # read the new k, v and write them into the cache
    pairs = int((q * (kv - q)).sum() + (q * (q + 1) // 2).sum())
    return kv_read + q_out + write, 4 * hq * d * pairs
