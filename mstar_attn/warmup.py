"""Warm-up: build (JIT-compile) and run once every kernel a spec's steps can reach, before serving.

FlashInfer compiles a module at its first use of each (kernel, dtype, head dim, window, soft-cap)
and FlashAttention-4 compiles per configuration too: minutes, which must not fall inside serving.
`kinds(spec)` lists what warm-up runs, as data and without a GPU, per backend the spec's steps may
take: decode (one token per request; and a batch past 256 requests, past every bucket), verify (a
few tokens over a cached one: the tensor-core decode kernels), prefill (the paged prefill kernels,
which extend and mixed steps share; short, and longer than one query tile: FA4 compiles the two
apart), shared-prefix steps (cascade specs), each over every layer group. `warmup(spec)` runs each kind twice on a pool
and cache of its own, a few pages large (the compiled kernels do not depend on the cache's size, so
the engine's own pool then finds them built): the first time (cold, compiling) and again (warm).
Scratch plans only (metadata.plan.scratch_plan): warm-up never touches a request's KV.

It also builds (once per machine) and loads the planner's compiled step builder (metadata/native.py).
Not covered: a page-table pool's Triton derive kernels (compiled at a pool's first StepRows commit
of each bucket, about a second each), draft rounds (their tensor-core decode kernels are the verify
kind's where the spec has a verify kind), latent attention (MLA) specs, and what a backend's
backend state compiles when the pool is made (XQA: outside the timed kinds).
"""

from __future__ import annotations

import time
from typing import Callable

import attrs
import torch

from mstar_attn.cache import PagedKVCache, default_device
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.capture.limits import PoolLimits
from mstar_attn.dense import DenseAttention, DenseHeads, DensePlan, build_dense_plan
from mstar_attn.kernels import run
from mstar_attn.metadata import native
from mstar_attn.metadata.backends import BACKENDS
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, Mode, scratch_plan, serves_trees
from mstar_attn.metadata.select import spec_backends
from mstar_attn.metadata.spec import AttentionSpec

WARMUP_PAGES = 8  # the warm-up pool's cache: a few pages (kernels are compiled per shape class, not per size)
BATCH = 2  # requests per warm-up step (a cascade step needs two)
VERIFY_Q_LEN = 2
LONG_Q_LEN = 129  # a prefill longer than one query tile (FA4 compiles short and long steps apart: flash_attn.py)
WIDE_BATCH = 257  # a decode batch past 256 requests (another FA4 kernel), past every bucket: eager


@attrs.frozen
class WarmupKind:
    """One kind of step warm-up runs: a backend, a mode, q_len new tokens per request, and whether it is
    a shared-prefix (cascade) step. Every layer group of the spec runs it."""

    backend: str
    mode: Mode
    q_len: int
    cascade: bool = False
    batch: int = BATCH
    tree: bool = False  # a token-tree verify step (scratch chains: the kernels a tree's mask runs)

    @property
    def name(self) -> str:
        return f"{self.backend} {self.mode.value}" + (f" q_len {self.q_len}" if self.q_len > 1 else "") + (
            " cascade" if self.cascade else "") + (" tree" if self.tree else "") + (
            f" batch {self.batch}" if self.batch != BATCH else "")


@attrs.frozen
class WarmupTime:
    """Seconds of one kind's first run (compiling what it needs) and of its second run."""

    kind: WarmupKind
    cold_s: float
    warm_s: float


@attrs.frozen
class WarmupReport:
    times: tuple[WarmupTime, ...]

    @property
    def cold_s(self) -> float:
        return sum(t.cold_s for t in self.times)

    @property
    def warm_s(self) -> float:
        return sum(t.warm_s for t in self.times)

    def __str__(self) -> str:
        rows = [f"{t.kind.name:<40} cold {t.cold_s:8.2f} s  warm {t.warm_s * 1e3:8.2f} ms" for t in self.times]
        return "\n".join(rows + [f"{'total':<40} cold {self.cold_s:8.2f} s  warm {self.warm_s * 1e3:8.2f} ms"])


def kinds(spec: AttentionSpec, backends: tuple[str, ...] | None = None, trees: bool = False) -> tuple[WarmupKind, ...]:
    """Every kind of step warm-up runs for `spec` (default backends: select.spec_backends(spec)). Pure: no GPU."""
    if not isinstance(spec, AttentionSpec):
        raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
    out = []
    for name in spec_backends(spec) if backends is None else backends:
        caps = BACKENDS.get(name)
        if caps is None:
            raise PlanError(f"backend: unknown backend {name!r} (known: {sorted(BACKENDS)})")
        caps.check(spec, name)
        if caps.prefix_free and spec.has_cross:
            raise PlanError(f"backend: {name!r} attends over the step's new K/V only; the spec's cross-attention layers "
                            "read the encoder's K/V from the cache (use a paged backend)")
        if not caps.prefix_free and "decode" in caps.modes:
            out += [WarmupKind(name, Mode.DECODE, 1), WarmupKind(name, Mode.DECODE, 1, batch=WIDE_BATCH)]
        if not caps.prefix_free and "verify" in caps.modes and all(g.causal for g in spec.groups):
            out.append(WarmupKind(name, Mode.VERIFY, min(VERIFY_Q_LEN, MAX_VERIFY_Q_LEN)))
        if caps.modes & {"prefill", "extend", "mixed"}:  # (prefix-free backends: prefill steps without a cached prefix)
            out += [WarmupKind(name, Mode.PREFILL, VERIFY_Q_LEN), WarmupKind(name, Mode.PREFILL, LONG_Q_LEN)]
        if spec.cascade_groups and caps.cascade:
            out.append(WarmupKind(name, Mode.DECODE, 1, cascade=True))
        if trees and caps.tree and serves_trees(spec):
            # a bucketed tree step and one past the warm-up pool's bucket (FlashInfer: its graph-mode and eager paths)
            out += [WarmupKind(name, Mode.VERIFY, VERIFY_Q_LEN, tree=True),
                    WarmupKind(name, Mode.VERIFY, VERIFY_Q_LEN, tree=True, batch=BATCH + 1)]
    return tuple(out)


def warmup(spec: AttentionSpec, *, backends: tuple[str, ...] | None = None, device: torch.device | str | None = None,
           progress: Callable[[int, int, WarmupTime], None] | None = None, trees: bool = False) -> WarmupReport:
    """Run every kind of kinds(spec, backends, trees) twice (trees: token-tree verify steps too, for an engine
    that verifies draft trees), on a pool and caches of WARMUP_PAGES pages of
    their own on `device` (None: CUDA when torch sees a device, else the CPU); returns each kind's cold and warm
    seconds. progress(i, n, time): called
    after each kind (i from 1). Raises PlanError for a spec a backend cannot serve."""
    todo = kinds(spec, backends, trees)
    if spec.mla:
        raise PlanError("warmup: latent attention (mla) specs are not warmed up yet; their kernels compile at first use")
    native.load()  # (the planner's compiled step builder: built once per machine, loaded once per process)
    small = attrs.evolve(spec, num_pages=WARMUP_PAGES)
    reads = max(WIDE_BATCH, BATCH * -(-LONG_Q_LEN // spec.page_size)) + 2 * BATCH  # (page entries a step lists)
    pool = GraphBufferPool(small, PoolLimits(max_batch_size=WIDE_BATCH,
                                             max_num_tokens=max(WIDE_BATCH, BATCH * LONG_Q_LEN), max_num_pages=reads,
                                             buckets=(BATCH,), max_encoder_tokens=BATCH * 4), device=device)
    caches = [PagedKVCache.allocate(small, pool.device, group=g) for g in range(len(small.groups))]
    gen = torch.Generator(device=pool.device).manual_seed(0)
    for c in caches:  # (finite values of the cache's dtype)
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen, device=pool.device).to(t.dtype))
    out = []
    for i, kind in enumerate(todo, 1):
        times = [_timed(pool, caches, kind, gen) for _ in range(2)]
        out.append(WarmupTime(kind, *times))
        if progress is not None:
            progress(i, len(todo), out[-1])
    return WarmupReport(tuple(out))


def _timed(pool: GraphBufferPool, caches: list[PagedKVCache], kind: WarmupKind, gen: torch.Generator) -> float:
    """Seconds to commit one step of `kind` and run every layer group on it, the device drained."""
    spec = pool.spec
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    t0 = time.perf_counter()
    plan = scratch_plan(spec, kind.batch, kind.q_len, backend=kind.backend, cascade=kind.cascade,
                        prefill=kind.mode is Mode.PREFILL, tree=kind.tree)
    step = pool.commit(plan)
    rows = step.padded_num_tokens

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, spec.head_dim, generator=gen, device=pool.device).to(spec.dtype)

    q = randn(spec.num_qo_heads)
    k, v = randn(spec.num_kv_heads), randn(spec.num_kv_heads)
    step.mark_stored()  # every cache: timing the kernels, what the scratch caches hold does not matter
    sinks = torch.zeros(spec.num_qo_heads, dtype=torch.float32, device=pool.device) if spec.has_sinks else None  # (a sink group's kernel variant)
    for g, cache in enumerate(caches):
        kv = dict(k=k, v=v) if BACKENDS[kind.backend].prefix_free else {}
        run(step, q, cache, group=g, sinks=sinks if spec.groups[g].sinks else None, **kv)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    return time.perf_counter() - t0


def warmup_dense(plan: DensePlan, device: torch.device | str = "cuda") -> WarmupTime:
    """Run the dense path (mstar_attn.dense: no KV cache) twice on random q, k, v of `plan`'s shapes,
    so its kernel is built before serving (an encoder's: build_dense_plan(..., causal=False))."""
    dense = DenseAttention(plan, device)
    gen = torch.Generator(device=dense.device).manual_seed(0)
    T = int(plan.cu_seqlens[-1])

    def once() -> float:
        t0 = time.perf_counter()
        q, k, v = (torch.randn(T, h, plan.head_dim, generator=gen, device=dense.device).to(plan.dtype)
                   for h in (plan.num_qo_heads, plan.num_kv_heads, plan.num_kv_heads))
        dense(q, k, v)
        if dense.device.type == "cuda":
            torch.cuda.synchronize(dense.device)
        return time.perf_counter() - t0

    cold = once()
    return WarmupTime(WarmupKind(plan.backend, Mode.PREFILL, T), cold, once())


def warmup_model(spec: AttentionSpec, dense_backend: str | None, device: torch.device | str | None = None,
                 progress: Callable[[int, int, WarmupTime], None] | None = None) -> WarmupReport:
    """warmup(spec), and for a spec with cross-attention layers (an encoder-decoder) the encoder's dense
    path too (warmup_dense on `dense_backend`, non-causal, spec's heads and head_dim): one report."""
    device = default_device(device)
    report = warmup(spec, device=device, progress=progress)
    if not spec.has_cross or dense_backend is None:
        return report
    H, D = spec.num_qo_heads, spec.head_dim
    plan = build_dense_plan([3, 5], DenseHeads(H, H, D), causal=False, dtype=spec.dtype, backend=dense_backend)
    return WarmupReport(report.times + (warmup_dense(plan, device),))


def cache_key() -> str:
    """What compiled kernels depend on here, as one line: FlashInfer's and FA4's versions, torch's and its
    CUDA's, and the GPU architecture (sm_XY; "cpu" without CUDA). A kernel cache built under another
    key is stale (benchmarks/jit_cache.sh refuses to load it)."""
    import importlib
    import importlib.metadata as md

    def version(dist: str, module: str) -> str:  # (installed, or only importable: a PYTHONPATH bundle)
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            try:
                return str(getattr(importlib.import_module(module), "__version__", "unknown"))
            except ImportError:
                return "none"

    arch = "cpu"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    return (f"flashinfer {version('flashinfer-python', 'flashinfer')} flash-attn-4 {version('flash-attn-4', 'flash_attn')} torch {torch.__version__} "
            f"cuda {torch.version.cuda or 'none'} {arch}")
