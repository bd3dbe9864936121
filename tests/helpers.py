"""Shared test helpers: seeds, random batches, a naive float64 oracle, filling a paged cache, and
the per-request comparison every correctness test uses. The scenario libraries (whole walks of steps
through a backend) live in tests/support/."""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn import AttentionSpec, Kind, LayerGroup, PagedKVCache, StepBatch, build_plan
from mstar_attn.kernels import reference


def fresh_seed() -> int:
    """A new random seed; tests put it in every failure message so a failure can be replayed."""
    return int(np.random.SeedSequence().entropy % 2**31)


# Per-request bounds of a kernel's output against the float32 reference on the same inputs (both
# sides read the same cache; the reference computes in float32). With u the dtype's unit roundoff
# (2^-8 bf16, 2^-11 fp16): the kernel rounds its output once (<= u |o| per element) and the
# probabilities P once before P @ V (<= u sum_j p_j |v_j| <= u max|v|); its float32 accumulation
# adds far less. So per request the norm-relative error is ~1.2u in RMS and stays under 2u, and
# every element is within u (|o| + max|v|) <= 8u max(1, max|o_i|) for V of unit scale (max|v| over
# 5k random normal keys is ~4.5). A dropped key of a 1k-token request moves that request by
# 2e-2..6e-2, of a 4k-token one by 1e-2..2.3e-2 (test_per_request_check_sees_one_dropped_key),
# over the bf16 bound either way; a batch-wide norm would see ~1e-4 of it.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def request_errors(out: torch.Tensor, want: torch.Tensor, plan) -> list[tuple[float, float, float]]:
    """Per request i: (norm-relative error, max abs error, max |want|) over rows qo_indptr[i]:qo_indptr[i+1], float64."""
    out, want = out.detach().double().cpu(), want.detach().double().cpu()
    errs = []
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        o, w = out[a:b], want[a:b]
        errs.append((((o - w).norm() / w.norm().clamp_min(1e-30)).item(), (o - w).abs().max().item(), w.abs().max().item()))
    return errs


def assert_close_per_request(out: torch.Tensor, want: torch.Tensor, plan, dtype: torch.dtype, context,
                             units: float = 2.0) -> None:
    """Every request of `out` within the bounds above of `want` (rows past plan.num_tokens are ignored):
    norm-relative <= units * u, elementwise <= 4 * units * u * max(1, max |want|) (units 2: the flat
    kernels' bound; a caller with more roundings passes its own). context: what to print on failure
    (the seed first)."""
    assert out.shape[1:] == want.shape[1:] and out.shape[0] >= plan.num_tokens, (context, out.shape, want.shape)
    T = plan.num_tokens
    assert torch.isfinite(out[:T]).all(), (context, "non-finite output")
    u = UNIT_ROUNDOFF[dtype]
    for i, (rel, abs_err, scale) in enumerate(request_errors(out[:T], want[:T], plan)):
        assert rel <= units * u and abs_err <= 4 * units * u * max(1.0, scale), (
            context, f"request {i} of {plan.batch_size} (q_len {plan.q_lens[i]}, kv_len {plan.kv_lens[i]}): "
                     f"norm-relative error {rel:.2e} (bound {units * u:.1e}), max abs {abs_err:.2e} "
                     f"(bound {4 * units * u * max(1.0, scale):.1e})")


def random_pages(rng: np.random.Generator, kv_lens, page_size: int, num_pages: int, extra: int = 0) -> list[np.ndarray]:
    """Distinct random pages for each request: exactly what it needs plus up to `extra` spare."""
    need = [(int(k) + page_size - 1) // page_size for k in kv_lens]
    counts = [n + int(rng.integers(0, extra + 1)) for n in need]
    if sum(counts) > num_pages:
        raise ValueError(f"random_pages: {sum(counts)} pages asked of a pool of {num_pages}")
    perm = rng.permutation(num_pages)[: sum(counts)].astype(np.int32)
    return np.split(perm, np.cumsum(counts)[:-1])


def draw_lengths(draw, page_sizes, max_requests: int, max_q: int, max_prefix: int):
    """Hypothesis: (page_size, q_lens, kv_lens) of a random valid step; draw is a composite's draw."""
    from hypothesis import strategies as st

    ps = draw(st.sampled_from(page_sizes))
    n = draw(st.integers(1, max_requests))
    q = draw(st.lists(st.integers(1, max_q), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, max_prefix), min_size=n, max_size=n))
    return ps, q, [a + b for a, b in zip(q, prefix)]


def random_batch(rng, q_lens, kv_lens, page_size: int, num_pages: int, extra: int = 0) -> StepBatch:
    pages = random_pages(rng, kv_lens, page_size, num_pages, extra)
    return StepBatch.from_pages(q_lens, kv_lens, pages, page_size)


def naive_attention(q, k, v, *, kind: Kind, window: int | None, scale: float, soft_cap: float = 0.0) -> torch.Tensor:
    """One sequence in float64 on the CPU, queries at the end: q [n_q, Hq, D], k and v [n_k, Hkv, D]
    (support.exact.exact_attention with the mask of `kind`)."""
    from tests.support.exact import exact_attention

    return exact_attention(q.cpu(), k.cpu(), v.cpu(), scale=scale, soft_cap=soft_cap, causal=kind is not Kind.NONCAUSAL,
                           window=window if kind is Kind.WINDOW else 0)


def fill_prefix(cache: PagedKVCache, batch: StepBatch, k_seqs, v_seqs) -> None:
    """Write each request's cached prefix (kv_len - q_len tokens) straight into its pages."""
    ps = cache.page_size
    for i in range(batch.batch_size):
        pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
        n = int(batch.kv_lens[i] - batch.q_lens[i])
        for p in range(n):
            cache.k[pages[p // ps], p % ps] = k_seqs[i][p]
            cache.v[pages[p // ps], p % ps] = v_seqs[i][p]


def spec_for(page_size=16, num_pages=512, dtype=torch.float32, groups=(LayerGroup(),), heads=(4, 2), head_dim=16, **kw):
    return AttentionSpec(heads[0], heads[1], head_dim, page_size, num_pages, dtype=dtype, groups=groups,
                         backend=kw.pop("backend", "reference"), **kw)


def make_step(seed, q_lens, kv_lens, page_size, dtype=torch.float32, groups=(LayerGroup(),), soft_cap=0.0, heads=(4, 2),
              head_dim=16, device="cpu", backend="reference", write=True):
    """A random step with its cache filled: the prefix written directly, the new tokens by the
    reference write_kv unless write=False. Returns spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum((k + page_size - 1) // page_size for k in kv_lens)
    spec = spec_for(page_size=page_size, num_pages=need + len(kv_lens) + 7, dtype=dtype, groups=groups, soft_cap=soft_cap,
                    heads=heads, head_dim=head_dim, backend=backend)
    batch = random_batch(rng, q_lens, kv_lens, page_size, spec.num_pages, extra=1)
    cache = PagedKVCache.allocate(spec, device)
    for t in (cache.k, cache.v):  # poison: stale (finite) data everywhere, the scratch page included
        t.copy_(torch.randn(t.shape, generator=gen))
    shape = lambda n: (n, spec.num_kv_heads, spec.head_dim)  # noqa: E731
    k_seqs = [torch.randn(shape(n), generator=gen).to(dtype).to(device) for n in kv_lens]
    v_seqs = [torch.randn(shape(n), generator=gen).to(dtype).to(device) for n in kv_lens]
    fill_prefix(cache, batch, k_seqs, v_seqs)
    plan = build_plan(batch, spec)
    new = lambda seqs: torch.cat([s[k - q :] for s, q, k in zip(seqs, q_lens, kv_lens)])  # noqa: E731
    k_new, v_new = new(k_seqs), new(v_seqs)
    if write:
        reference.write_kv(plan, k_new, v_new, cache)
    q = torch.randn((plan.num_tokens, spec.num_qo_heads, spec.head_dim), generator=gen).to(dtype).to(device)
    return spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new


# the layer groups the GPU backend tests cover: full causal, a sliding window, non-causal
GPU_GROUPS = (LayerGroup(), LayerGroup("window", window=40), LayerGroup("noncausal"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative error of a against b, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def pool_of(spec, **kw):
    """GraphBufferPool(spec, PoolLimits(...), ...) from one set of keywords: the PoolLimits fields go into
    the record, the rest (device, num_slots, float_workspace_bytes) to the pool."""
    from mstar_attn import GraphBufferPool, PoolLimits
    from mstar_attn.capture.limits import NAMES

    return GraphBufferPool(spec, PoolLimits(**{k: kw.pop(k) for k in NAMES if k in kw}), **kw)


def gpu_pool(spec, **kw):
    """A GraphBufferPool on CUDA sized for the GPU tests' steps."""
    kw.setdefault("max_pages_per_request", 5000)  # FA4's page tables: 4,100-token requests at page size 1
    return pool_of(spec, max_batch_size=kw.pop("max_batch_size", 300), max_num_tokens=4096,
                   max_num_pages=spec.num_pages, device="cuda", **kw)


def random_cache(spec, seed: int, device="cuda", group: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> PagedKVCache:
    """A cache of spec.cache_shape filled with seeded normal values (finite, never zeros). An FP8 cache
    (k_scale, v_scale its scales) is filled through the quantizing store, every slot."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = PagedKVCache.allocate(spec, device, group=group, k_scale=k_scale, v_scale=v_scale)
    if not spec.fp8_kv:
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(spec.dtype))
        return cache
    k, v = cache.flat()
    for a in range(0, k.shape[0], 1 << 15):
        idx = torch.arange(a, min(a + (1 << 15), k.shape[0]), device=device)
        cache.store(idx, *(torch.randn(idx.shape[0], *t.shape[1:], generator=gen, device=device) for t in (k, v)))
    return cache


def marked(step, *caches):
    """`step`, marked stored in each of `caches` (step.mark_stored): caches filled by hand, the step's
    new K/V already at its slots (or, timing, their values do not matter), so no write_kv runs."""
    for cache in caches:
        step.mark_stored(cache)
    return step


def disjoint(tensors) -> bool:
    """Whether no two of `tensors` share a byte of memory (their [data_ptr, data_ptr + bytes) ranges)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def attend_filled(run, cache, group: int | None = None):
    """fn(step, x) -> run(step, x["q"], cache, group) for DecodeGraphs over a cache filled by hand (or
    stored into outside the graph): the step marked stored first (marked), capture's scratch steps too."""
    def fn(step, x):
        return run(marked(step, cache), x["q"], cache, group=group)
    return fn


def replay_or_run(graphs, step, x: dict, eager, context) -> tuple[torch.Tensor, bool]:
    """(output, replayed): graphs(step, **x) when a graph serves `step` (a DeviceStep, or a round's
    steps), checked bit-equal to eager(step, x), which rewrites the same K/V bytes; else eager(step, x)."""
    if graphs is None or not graphs.serves(step):
        return eager(step, x), False
    out = graphs(step, **x).clone()
    assert torch.equal(out, eager(step, x)), context
    return out, True


def smoke_first(cases, pick=None) -> list:
    """`cases` (an iterable of parametrize values: single values or tuples) with the ones pick(case) selects
    (default: the first) marked smoke: the quick tier, `pytest -m smoke`, one case per backend and feature."""
    import pytest

    cases = list(cases)
    chosen = (lambda c: c == cases[0]) if pick is None else pick
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.smoke) if chosen(c) else c for c in cases]
