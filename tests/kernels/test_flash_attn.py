"""FlashAttention-4 backend through GraphBufferPool, against the reference backend.

CPU tests run the real pool and PoolState with FA4 replaced by `fake_varlen`, a plain-torch model
of the contract FA4's interface.py documents (page table rows, seqused_k, bottom-right masks):
they check the page tables, lengths and arguments this backend passes. GPU tests (marker gpu)
run the real kernels: here what only FA4 has (varlen prefill, its page-table bounds, finite caches);
the scenarios every paged backend runs are in test_paged_backends.py.
"""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, Mode, PagedKVCache, PlanError, build_plan
from mstar_attn.kernels import flash_attn as fa
from mstar_attn.kernels import reference
from tests.helpers import (
    GPU_GROUPS, assert_close_per_request, fresh_seed, gpu_pool, make_step, pool_of, random_batch, random_cache,
)
from tests.support.paged_scenarios import MODES as GPU_MODES


def _why_no_fa4():
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as e:
        return f"needs flash_attn.cute (pip install flash-attn-4): {e}"
    return None


NO_FA4 = _why_no_fa4()


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(NO_FA4 is not None, reason=NO_FA4 or "")(test))


GROUPS = GPU_GROUPS


# ---------------------------------------------------------------------------------------------
# A plain-torch model of flash_attn.cute.flash_attn_varlen_func, for the CPU tests.


def fake_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                page_table=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, num_splits=1,
                **unexpected):
    """FA4's documented forward: bottom-right aligned causal / window masks, paged or varlen K/V.

    Asserts the input contract the backend must meet (int32 stride-1 lengths, one page-table row
    and one seqused_k per sequence, cu_seqlens_k only without a page table, num_splits=1 for SM90).
    """
    assert not unexpected, unexpected
    assert num_splits == 1 and softmax_scale is not None
    B = cu_seqlens_q.shape[0] - 1
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table):
        assert t is None or (t.dtype == torch.int32 and t.stride(-1) == 1)
    cu_q = cu_seqlens_q.tolist()
    assert cu_q[0] == 0 and cu_q[-1] == q.shape[0]
    if page_table is not None:
        assert cu_seqlens_k is None and seqused_k.shape == (B,) and page_table.shape[0] == B and page_table.is_contiguous()
        page_size = k.shape[1]
        used = seqused_k.tolist()
        assert max(used) <= page_table.shape[1] * page_size
    else:
        assert seqused_k is None and cu_seqlens_k.shape == (B + 1,)
        cu_k = cu_seqlens_k.tolist()
        used = [cu_k[b + 1] - cu_k[b] for b in range(B)]
    left, right = window_size
    if causal:
        right = 0
    rep = q.shape[1] // k.shape[-2]
    out = torch.empty_like(q)
    for b in range(B):
        sq, sk = cu_q[b + 1] - cu_q[b], used[b]
        assert max_seqlen_q is None or sq <= max_seqlen_q
        assert max_seqlen_k is None or sk <= max_seqlen_k
        if page_table is not None:
            pages = page_table[b, : (sk + page_size - 1) // page_size].long()
            kb, vb = (x[pages].flatten(0, 1)[:sk] for x in (k, v))
        else:
            kb, vb = k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        kb, vb = (x.float().repeat_interleave(rep, dim=1) for x in (kb, vb))
        logits = torch.einsum("qhd,khd->hqk", q[cu_q[b] : cu_q[b + 1]].float(), kb) * softmax_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        hidden = torch.zeros(sq, sk, dtype=torch.bool)
        if right is not None:
            hidden |= j > i + right
        if left is not None:
            hidden |= j < i - left
        logits = logits.masked_fill(hidden, float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), vb).to(q.dtype)
    return out, None


@pytest.fixture
def cpu_pool(monkeypatch):
    """make(spec, **pool_kw): a real GraphBufferPool on the CPU (its copies are synchronous), with
    FA4 replaced by fake_varlen."""
    monkeypatch.setattr(fa, "_varlen_func", lambda: fake_varlen)

    def make(spec, **kw):
        return pool_of(spec, max_batch_size=kw.pop("max_batch_size", 64), max_num_tokens=1024,
                       max_num_pages=spec.num_pages, device="cpu", **kw)

    return make


def cpu_step(seed, q_lens, kv_lens, page_size=16, heads=(8, 2), soft_cap=0.0, backend="flash_attn", groups=GROUPS):
    return make_step(seed, q_lens, kv_lens, page_size, torch.bfloat16, groups=groups, heads=heads, head_dim=64,
                     backend=backend, soft_cap=soft_cap, write=False)


# ---------------------------------------------------------------------------------------------
# CPU: plan-time capability errors, the ImportError, and the backend's plumbing through the pool.


def test_what_the_backend_cannot_serve_fails_at_plan_time():
    with pytest.raises(PlanError, match="spec.dtype"):
        AttentionSpec(8, 2, 128, 16, 64, dtype=torch.float32, backend="flash_attn")
    with pytest.raises(PlanError, match="spec.head_dim"):
        AttentionSpec(8, 2, 256, 16, 64, dtype=torch.bfloat16, backend="flash_attn")
    with pytest.raises(PlanError, match="spec.head_dim"):
        AttentionSpec(8, 2, 80, 16, 64, dtype=torch.float16, backend="flash_attn_varlen")
    spec = AttentionSpec(8, 2, 128, 16, 64, backend="flash_attn_varlen")
    rng = np.random.default_rng(0)
    for q_lens, kv_lens, mode in [([1, 1], [5, 9], "decode"), ([3, 4], [10, 4], "extend"), ([2, 2], [9, 9], "verify")]:
        with pytest.raises(PlanError, match=f"not this {mode} step"):
            build_plan(random_batch(rng, q_lens, kv_lens, 16, 64), spec)
    assert build_plan(random_batch(rng, [3, 4], [3, 4], 16, 64), spec).backend == "flash_attn_varlen"


@pytest.mark.skipif(NO_FA4 is None, reason="flash_attn.cute is installed")
def test_missing_fa4_names_the_package():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install flash-attn-4"):
            fa._varlen_func()
    else:
        pytest.skip("flash_attn.cute imports here")


@pytest.mark.parametrize("page_size, heads, soft_cap", [(16, (8, 2), 0.0), (64, (4, 4), 20.0)], ids=["p16-gqa4", "p64-mha-cap"])
@pytest.mark.parametrize("q_lens, kv_lens, mode", GPU_MODES, ids=[m[2] for m in GPU_MODES])
def test_cpu_every_mode_through_the_pool(cpu_pool, q_lens, kv_lens, mode, page_size, heads, soft_cap):
    seed = fresh_seed()
    spec, plan, cache, q, _, _, k_new, v_new = cpu_step(seed, q_lens, kv_lens, page_size, heads, soft_cap)
    mode = Mode(mode)
    assert plan.mode is mode
    pool = cpu_pool(spec, buckets=(1, 2, 8))
    step = pool.commit(plan)
    fa.write_kv(step, k_new, v_new, cache)
    ref_cache = PagedKVCache(cache.k.clone(), cache.v.clone())
    reference.write_kv(plan, k_new, v_new, ref_cache)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
    if mode is Mode.DECODE:  # bucketed: the captured shape, padding rows on the scratch page
        assert step.padded_batch_size == 8 and all(t.shape == (8, pool.max_pages_per_request) for t in step.scheduled)
        assert all((t[5:, 0] == spec.scratch_page).all() for t in step.scheduled)
    for g in range(len(spec.groups)):
        want = reference.run(plan, q.float(), cache, group=g)
        out = fa.run(step, q, cache, group=g)
        assert out.shape == q.shape
        assert_close_per_request(out, want, plan, spec.dtype, (f"seed {seed}", mode, spec.groups[g]))
        if mode is Mode.DECODE:  # as a captured graph calls it: all 8 rows
            padded = fa.run(step, torch.cat([q, q[:1].expand(3, -1, -1)]), cache, group=g)
            assert torch.equal(padded[:5], out) and torch.isfinite(padded).all()


def test_cpu_varlen_prefill_reads_the_new_kv(cpu_pool):
    seed = fresh_seed()
    spec, plan, cache, q, _, _, k_new, v_new = cpu_step(seed, [64, 300, 7], [64, 300, 7], backend="flash_attn_varlen")
    step = cpu_pool(spec).commit(plan)
    assert step.scheduled == (None,) * 3
    fa.write_kv(step, k_new, v_new, cache)
    for g in range(3):
        out = fa.run(step, q, cache, group=g, k=k_new, v=v_new)
        assert_close_per_request(out, reference.run(plan, q.float(), cache, group=g), plan, spec.dtype, (f"seed {seed}", g))
    with pytest.raises(PlanError, match="pass k and v"):
        fa.run(step, q, cache)


def test_cpu_bucketed_verify_takes_padded_rows(cpu_pool):
    """Verify steps (causal groups) are bucketed: padding requests have q_len rows each and read
    the scratch page; run takes the real rows or whole padded requests."""
    seed = fresh_seed()
    spec, plan, cache, q, _, _, k_new, v_new = cpu_step(seed, [4, 4, 4], [5, 40, 129], groups=GROUPS[:2])
    step = cpu_pool(spec, buckets=(1, 2, 8)).commit(plan)
    assert (step.bucket, step.q_len, step.padded_num_tokens) == (8, 4, 32)
    assert all(t.shape == (8, step.plan.spec.num_pages) and (t[3:, 0] == spec.scratch_page).all() for t in step.scheduled)
    fa.write_kv(step, k_new, v_new, cache)
    for g in range(2):
        out = fa.run(step, q, cache, group=g)
        assert_close_per_request(out, reference.run(plan, q.float(), cache, group=g), plan, spec.dtype, (f"seed {seed}", g))
        padded = fa.run(step, torch.cat([q, q[:4].repeat(5, 1, 1)]), cache, group=g)
        assert torch.equal(padded[:12], out) and torch.isfinite(padded).all()
    with pytest.raises(PlanError, match=r"b \* 4 for b in 3..8"):
        fa.run(step, q[:11], cache)


def test_cpu_page_tables_keep_their_memory_and_shape_per_slot_and_bucket(cpu_pool):
    """What graph replay needs: every bucketed decode commit to a slot fills the same [rows, width]
    view; window groups (trimmed front pages) get a table of their own, full and non-causal share one."""
    rng = np.random.default_rng(fresh_seed())
    spec = AttentionSpec(8, 2, 64, 16, 4000, groups=GROUPS, backend="flash_attn")
    pool = cpu_pool(spec, buckets=(4, 16), max_pages_per_request=100)
    seen = {}
    for _ in range(12):
        B = int(rng.integers(5, 17))
        plan = build_plan(random_batch(rng, np.ones(B, np.int32), rng.integers(1, 1500, B), 16, 4000), spec)
        step = pool.commit(plan)
        ptrs = tuple(t.data_ptr() for t in step.scheduled)
        assert ptrs[0] == ptrs[2] != ptrs[1]
        assert seen.setdefault(step.slot, (ptrs, step.scheduled[0].shape)) == (ptrs, (16, 100))
        for g, gp in enumerate(plan.groups):  # row i holds exactly the group's pages of request i
            table = step.scheduled[g]
            for i in range(B):
                pages = gp.kv_indices[gp.kv_indptr[i] : gp.kv_indptr[i + 1]]
                assert np.array_equal(table[i, : len(pages)].numpy(), pages)
    extend = build_plan(random_batch(rng, [3, 9], [40, 9], 16, 4000), spec)
    step = pool.commit(extend)  # eager: as wide as the widest request
    assert step.scheduled[0].shape == (2, 3) and step.scheduled[0].is_contiguous()


def test_cpu_request_past_max_pages_per_request_fails_at_commit(cpu_pool):
    spec, plan, *_ = cpu_step(fresh_seed(), [1, 1], [5, 16 * 9 + 1])
    pool = cpu_pool(spec, max_pages_per_request=9)
    with pytest.raises(PlanError, match=r"group 0, request 1 reads 10 pages, more than the pool's max_pages_per_request 9"):
        pool.commit(plan)
    # the limit is on the pages a group reads: a window group's trimmed list (2 of 12 pages) fits
    spec, plan, *_ = cpu_step(fresh_seed(), [1, 1], [5, 16 * 12], groups=(LayerGroup("window", window=20),))
    assert cpu_pool(spec, max_pages_per_request=9).commit(plan).scheduled[0].shape == (2, 9)


# ---------------------------------------------------------------------------------------------
# GPU: the real FA4 kernels.


def gpu_step(seed, q_lens, kv_lens, page_size=16, dtype=torch.bfloat16, heads=(32, 8), head_dim=128, soft_cap=0.0,
             backend="flash_attn", groups=GROUPS):
    return make_step(seed, q_lens, kv_lens, page_size, dtype, groups=groups, heads=heads, head_dim=head_dim,
                     device="cuda", backend=backend, soft_cap=soft_cap, write=False)


@pytest.mark.smoke
@gpu
def test_varlen_prefill_matches_the_reference():
    seed = fresh_seed()
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, [64, 300, 7], [64, 300, 7], backend="flash_attn_varlen")
    step = gpu_pool(spec).commit(plan)
    fa.write_kv(step, k_new, v_new, cache)
    for g in range(len(spec.groups)):
        out = fa.run(step, q, cache, group=g, k=k_new, v=v_new)
        want = reference.run(plan, q.float(), cache, group=g)
        assert_close_per_request(out, want, plan, spec.dtype, (f"seed {seed}", spec.groups[g]))


@gpu
def test_request_past_max_pages_per_request_fails_at_commit():
    spec, plan, *_ = gpu_step(fresh_seed(), [1, 1], [5, 16 * 9 + 1])
    with pytest.raises(PlanError, match="request 1 reads 10 pages"):
        gpu_pool(spec, max_pages_per_request=9).commit(plan)


@gpu
def test_a_cache_not_known_finite_is_refused():
    """FA4 reads whole pages: a cache wrapped without the finiteness check (possibly uninitialised
    rows) is refused by name; from_tensors checks it once and lets it through."""
    spec, plan, cache, q, *_ = gpu_step(fresh_seed(), [1, 1], [5, 40])
    step = gpu_pool(spec).commit(plan)
    step.mark_stored(cache)  # (the values do not matter here)
    with pytest.raises(PlanError, match="known finite"):
        fa.run(step, q, PagedKVCache(cache.k, cache.v))
    fa.run(step, q, PagedKVCache.from_tensors(cache.k, cache.v))
    bad = cache.k.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(PlanError, match="non-finite"):
        PagedKVCache.from_tensors(bad, cache.v)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_own_page_lists_through_the_pool(cpu_pool, page_size):
    """A hybrid model's window group on its own page list, its passed pages given back and reused:
    the page tables and slots the pool and this backend derive serve the exact attention per request."""
    from tests.support.group_pages import HybridTrace, serve

    seed = fresh_seed()
    groups = (LayerGroup(), LayerGroup("window", window=21, own_pages=True))
    spec = AttentionSpec(8, 2, 64, page_size, 3000, groups=groups, layer_groups=(0, 1), soft_cap=4.0, backend="flash_attn")
    trace = HybridTrace(spec, seed, max_batch=6, max_prompt=50)
    pool = cpu_pool(spec, buckets=(1, 4, 8))
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    ran = serve(trace, pool, fa, caches, 12, seed)
    assert {m for m, _ in ran} >= {"decode", "verify"}, ran


def test_cpu_cross_attention_through_the_pool(cpu_pool):
    """Cross-attention layers through the pool and this backend's page tables: encoder K/V stored
    at each request's first step, read non-causally after, every request against the exact attention."""
    from tests.support.cross_pages import GROUPS, CrossTrace, serve

    seed = fresh_seed()
    spec = AttentionSpec(8, 2, 64, 16, 3000, groups=GROUPS, layer_groups=(0, 1), backend="flash_attn")
    trace = CrossTrace(spec, seed, max_batch=6, max_encoder=400)
    pool = cpu_pool(spec, buckets=(1, 4, 8), max_encoder_tokens=4000)
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    ran = serve(trace, pool, fa, caches, 12, seed)
    assert any(stored for *_, stored in ran) and any(m == "decode" for m, *_ in ran), ran


def test_cpu_cross_rows_through_the_pool(cpu_pool):
    """As above, with the encoder pages in the pool's cross table (CrossRows): gathered on the device."""
    from tests.support.cross_pages import GROUPS, CrossTrace, serve

    seed = fresh_seed()
    spec = AttentionSpec(8, 2, 64, 16, 3000, groups=GROUPS, layer_groups=(0, 1), backend="flash_attn")
    pool = cpu_pool(spec, buckets=(1, 4, 8), max_encoder_tokens=4000, max_requests=32, max_pages_per_request=64)
    trace = CrossTrace(spec, seed, max_batch=6, max_encoder=400, table=pool.cross_table)
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    ran = serve(trace, pool, fa, caches, 12, seed)
    assert any(stored for *_, stored in ran) and any(m == "decode" for m, *_ in ran), ran
