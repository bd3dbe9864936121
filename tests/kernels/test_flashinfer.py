"""FlashInfer backend through GraphBufferPool, eager and replayed, against the reference per request (GPU only):
what only FlashInfer has (its signatures, ragged prefill, wrappers and workspaces, the fixed schedule, FP8 KV).
The scenarios every paged backend runs are in test_paged_backends.py."""

import inspect

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, PoolLimits, StepBatch, build_plan
from mstar_attn.kernels import reference
from tests.helpers import (
    GPU_GROUPS, assert_close_per_request, attend_filled, disjoint, fresh_seed, gpu_pool, make_step, marked, random_batch,
    random_cache,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import _flashinfer_fast  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402


def gpu_step(seed, q_lens, kv_lens, page_size=16, dtype=torch.bfloat16, heads=(32, 8), head_dim=128, soft_cap=0.0,
             groups=GPU_GROUPS, backend="flashinfer"):
    return make_step(seed, q_lens, kv_lens, page_size, dtype, groups=groups, heads=heads, head_dim=head_dim,
                     device="cuda", backend=backend, soft_cap=soft_cap, write=False)


def test_flashinfer_signatures_are_the_ones_we_call():
    """Fails loudly when FlashInfer moves the arguments mstar_attn.kernels.flashinfer passes."""
    assert flashinfer.__version__.startswith("0.7.2")
    need = {
        flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan: {"window_left", "seq_lens", "logits_soft_cap", "sm_scale", "non_blocking", "q_data_type", "kv_data_type"},
        flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan: {"causal", "window_left", "seq_lens", "logits_soft_cap", "sm_scale"},
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper.plan: {"causal", "window_left", "logits_soft_cap", "sm_scale"},
        flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__: {"use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"},
    }
    for fn, names in need.items():
        # plan() forwards **kwargs to _plan_impl where FlashInfer has one: check what really binds them.
        impl = getattr(_owner(fn), "_plan_impl", fn) if fn.__name__ == "plan" else fn
        assert names <= set(inspect.signature(impl).parameters), fn.__qualname__


def _owner(fn):
    return getattr(flashinfer, fn.__qualname__.split(".")[0])


@pytest.mark.smoke
def test_ragged_prefill_matches_the_reference():
    seed = fresh_seed()
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, [64, 300, 7], [64, 300, 7], backend="flashinfer_ragged")
    assert plan.backend == "flashinfer_ragged"
    step = gpu_pool(spec).commit(plan)
    assert isinstance(step.scheduled[0], flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
    fi.write_kv(step, k_new, v_new, cache)
    for g in range(len(spec.groups)):
        out = fi.run(step, q, cache, group=g, k=k_new, v=v_new)
        assert_close_per_request(out, reference.run(plan, q.float(), cache, group=g), plan, spec.dtype, (f"seed {seed}", g))


def test_double_buffering_lets_the_host_run_ahead():
    """Commit step N+1 while the GPU is still busy before step N: two slots never stall, one does.

    Both runs stay correct (a slot is reused only after its copies ran), so removing the
    second buffer shows up as a stall, not as wrong output.
    """
    seed = fresh_seed()
    spec, plan_a, cache, q_a, *_ = gpu_step(seed, [1] * 8, list(range(100, 108)), groups=GPU_GROUPS[:1])
    plan_b = build_plan(random_batch(np.random.default_rng(seed + 1), [1] * 8, list(range(107, 99, -1)), 16, spec.num_pages), spec)
    for slots, stalls in [(2, 0), (1, 1)]:
        pool = gpu_pool(spec, num_slots=slots)
        for _ in range(2):  # warm up the wrappers
            fi.run(marked(pool.commit(plan_a), cache), q_a, cache)  # (the cache is filled by hand)
        torch.cuda.synchronize()
        pool.stalls = 0
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the commits
        out_a = fi.run(marked(pool.commit(plan_a), cache), q_a, cache).clone()
        out_b = fi.run(marked(pool.commit(plan_b), cache), q_a, cache)
        torch.cuda.synchronize()
        assert pool.stalls == stalls
        for plan, out in ((plan_a, out_a), (plan_b, out_b)):
            assert_close_per_request(out, reference.run(plan, q_a.float(), cache), plan, spec.dtype, (f"seed {seed}", slots))


@pytest.mark.parametrize("heads, q_len", [((32, 8), 1), ((8, 8), 1), ((32, 8), 4)], ids=["tensor-cores", "cuda-cores", "verify"])
def test_fast_replan_matches_public_plan(heads, q_len):
    """The internals _flashinfer_fast reads: the fast re-plan must leave a graph-mode wrapper in
    the state public plan() leaves it: the same plan info and a bit-identical output over the
    same cache, on changing lengths. (The int workspace itself is not compared: the CUDA-core
    planner leaves unwritten gaps in it.) Fails loudly when FlashInfer moves them."""
    from mstar_attn.kernels._flashinfer_fast import VERSIONS

    assert flashinfer.__version__ in VERSIONS, f"re-check _flashinfer_fast against FlashInfer {flashinfer.__version__}"
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    B, ps = 16, 16
    spec = AttentionSpec(*heads, 128, ps, 512)
    cache = random_cache(spec, seed)
    pools = [gpu_pool(spec, buckets=(B,)), gpu_pool(spec, buckets=(B,))]
    for pool in pools:
        pool.backend_state("flashinfer").use_fast = pool is pools[1]
    first = build_plan(random_batch(rng, [q_len] * B, [q_len + 1] * B, ps, spec.num_pages), spec)
    for pool in pools:
        pool.commit(first, slot=0)  # public plan() in both
    for i in range(6):
        kv = rng.integers(q_len + 1, 6 * ps, B)
        plan = build_plan(random_batch(rng, [q_len] * B, kv, ps, spec.num_pages), spec)
        public, fast = (marked(pool.commit(plan, slot=0), cache) for pool in pools)  # (random K/V already at every slot)
        wp, wf = public.scheduled[0], fast.scheduled[0]
        assert wp is not wf and (0, 0, B, q_len) in pools[1].backend_state("flashinfer").fast
        assert (0, 0, B, q_len) not in pools[0].backend_state("flashinfer").fast
        assert list(wp._plan_info) == list(wf._plan_info), (f"seed {seed}", i)
        q = torch.randn(B * q_len, heads[0], 128, device="cuda", dtype=torch.bfloat16)
        out_p, out_f = fi.run(public, q, cache), fi.run(fast, q, cache)
        assert torch.equal(out_p, out_f), (f"seed {seed}", i)
        assert_close_per_request(out_f, reference.run(plan, q.float(), cache), plan, spec.dtype, (f"seed {seed}", i))


def test_wrappers_share_the_slot_workspaces():
    """The internals share_workspace sets: every graph-mode wrapper plans into an int workspace of its own
    (graph_workspace_bytes) through its own pinned mirror, the eager wrappers of one (slot, group) into that
    pair's, and all run with the pool's float workspace. Graphs of three buckets and two q_lens each replay the
    latest commit correctly (eager steps past the largest bucket between them), and the pool's memory report
    counts each workspace once."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, 16, 9000, groups=GPU_GROUPS[:2])
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=80, max_num_tokens=512, max_num_pages=9000,
                                            buckets=(4, 16, 64)))
    static = torch.zeros(256, 32, 128, device="cuda", dtype=torch.bfloat16)
    graphs = [DecodeGraphs(pool, attend_filled(fi.run, cache, g), {"q": static}) for g in range(2)]
    for gr in graphs:
        gr.capture(q_lens=(1, 4))
    sched = pool.backend_state("flashinfer")
    own = {w._int_workspace_buffer.data_ptr() for w in sched.wrappers.values()}
    assert len(own) == len(sched.wrappers) == 2 * 2 * 3 * 2  # slots x groups x buckets x q_lens: one workspace each
    assert {(ws.data_ptr(), pinned.data_ptr()) for ws, pinned in sched.private} == {
        (w._int_workspace_buffer.data_ptr(), w._pin_memory_int_workspace_buffer.data_ptr()) for w in sched.wrappers.values()}
    for (kind, slot, g, B, q_len), w in sched.wrappers.items():
        assert kind == "graph" and w._float_workspace_buffer is sched.float_ws
        assert w._int_workspace_buffer.numel() == _flashinfer_fast.graph_workspace_bytes(B, q_len, 4, 8, sched.sms)
    for i in range(24):
        B, q_len = int(rng.integers(1, 65)) if i != 5 else 72, int(rng.choice([1, 4]))  # (past 64: an eager step)
        plan = build_plan(random_batch(rng, [q_len] * B, rng.integers(q_len + 1, 1500, B), 16, spec.num_pages), spec)
        step = pool.commit(plan)
        q = torch.randn(plan.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
        for g, gr in enumerate(graphs):
            assert gr.serves(step) == (B <= 64)
            out = gr(step, q=q) if B <= 64 else attend_filled(fi.run, cache, g)(step, {"q": q})
            assert_close_per_request(out, reference.run(plan, q.float(), cache, group=g), plan, spec.dtype, (f"seed {seed}", i, g))
    for (kind, slot, g, *_), w in sched.wrappers.items():
        if kind != "graph":
            assert w._int_workspace_buffer is sched.int_ws[slot][g], (kind, slot, g)
            assert w._pin_memory_int_workspace_buffer is sched.pinned_ws[slot][g], (kind, slot, g)
            assert w._float_workspace_buffer is sched.float_ws
    assert any(key[0] != "graph" for key in sched.wrappers), f"seed {seed}: no eager step"
    report = pool.memory_report().components
    assert report["flashinfer int workspaces"] == (4 * fi.INT_WORKSPACE_BYTES, 4 * fi.INT_WORKSPACE_BYTES)
    m = sum(ws.numel() for ws, _ in sched.private)
    assert report[f"flashinfer graph-mode int workspaces ({len(sched.private)})"] == (m, m)
    own = report[f"flashinfer wrappers' own buffers ({len(sched.wrappers)} wrappers)"]
    assert own[0] < len(sched.wrappers) * 64 << 10 and own[1] < fi.INT_WORKSPACE_BYTES, own  # small arrays, no workspace


def test_replay_follows_new_plans_on_the_public_plan_path():
    """Without the pinned fast path (another FlashInfer version) every bucketed commit re-plans the
    same graph-mode wrapper through public plan(), so captured graphs still follow each commit."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, 16, 2000)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=16, max_num_tokens=256, max_num_pages=2000, buckets=(8, 16)))
    pool.backend_state("flashinfer").use_fast = False
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": torch.zeros(16, 32, 128, device="cuda",
                                                                                dtype=torch.bfloat16)})
    graphs.capture()
    for i in range(20):
        B = int(rng.integers(1, 17))
        plan = build_plan(random_batch(rng, np.ones(B, np.int32), rng.integers(1, 900, B), 16, spec.num_pages), spec)
        step = pool.commit(plan)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
        assert graphs.serves(step)
        assert_close_per_request(graphs(step, q=q), reference.run(plan, q.float(), cache), plan, spec.dtype, (f"seed {seed}", i))
    assert not pool.backend_state("flashinfer").fast


def test_fixed_schedule_buckets_are_planned_once_and_stay_correct():
    """A bucket at or past fixed_min_ctas is planned once without split-KV (the plan info says so)
    and never re-planned; smaller ones keep split-KV. Lengths grow 40x after the plan."""
    seed = fresh_seed()
    spec, plan, cache, q, *_ = gpu_step(seed, [1] * 70, list(np.random.default_rng(seed).integers(2000, 4000, 70)))
    pool = gpu_pool(spec, buckets=(4, 128))
    sched = pool.backend_state("flashinfer")
    sched.fixed_min_ctas = 4 * torch.cuda.get_device_properties(0).multi_processor_count  # (off by default)
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": torch.zeros(128, 32, 128, device="cuda",
                                                                                dtype=torch.bfloat16)})
    graphs.capture()  # planned on kv_len 1
    assert 128 * 8 >= sched.fixed_min_ctas > 4 * 8
    assert {k[2] for k in sched.fixed} == {128} and {k[2] for k in sched.fast} == {4}
    from mstar_attn.kernels._flashinfer_fast import split_kv
    assert all(not split_kv(w) for w in sched.fixed.values())
    step = pool.commit(plan)
    assert step.scheduled[0] is sched.fixed[(step.slot, 0, 128, 1)]
    assert_close_per_request(graphs(step, q=q), reference.run(plan, q.float(), cache), plan, torch.bfloat16, f"seed {seed}")


def test_no_device_sync_on_the_page_table_path():
    """After warm-up (the first commit of a bucket captures its device graph), StepRows commits
    with table updates, and their replays, never sync the device."""
    from mstar_attn.metadata.batch import StepRows

    seed = fresh_seed()
    spec = AttentionSpec(32, 8, 128, 16, 4000, groups=GPU_GROUPS[:2])
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=16, max_num_tokens=64, max_num_pages=4000, buckets=(8,),
                                            max_requests=32, max_pages_per_request=64))
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": torch.zeros(8, 32, 128, device="cuda",
                                                                                dtype=torch.bfloat16)})
    graphs.capture()
    for r in range(6):
        pool.table.assign(r, list(range(r * 20, r * 20 + 10)))
    kv = np.full(6, 16 * 9, np.int32)
    q = torch.randn(6, 32, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        graphs(pool.commit(build_plan(StepRows.decode(range(6), kv), spec)), q=q)  # each slot's first commit: capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(4):
            kv += 16
            pool.table.append(range(6), [r * 20 + 10 + i for r in range(6)])
            step = pool.commit(build_plan(StepRows.decode(range(6), kv), spec))
            out = graphs(step, q=q)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    csr = build_plan(StepBatch.from_pages([1] * 6, kv, [pool.table.pages(r) for r in range(6)], 16), spec)
    assert_close_per_request(out, reference.run(csr, q.float(), cache), csr, torch.bfloat16, f"seed {seed}")


@pytest.mark.smoke
def test_fp8_kv_eager_and_replayed():
    """An FP8 (e4m3) cache with per-tensor scales: decode and verify steps replayed, prefill, extend
    and mixed eager, every request against the reference over the same quantized cache (which reads
    value * scale in float32). Bound: FP8 values are exact in bf16, so the kernel computes as over a
    bf16 cache (the usual 2u per request), then scales its bf16 output by v_scale, one more rounding
    (<= u): 3u in norm, 9u elementwise."""
    from mstar_attn import PagedKVCache
    from tests.helpers import UNIT_ROUNDOFF, request_errors

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = 8000  # the most a step below can ask: 39 requests x 3,000 tokens / 16 = 7,313
    spec = AttentionSpec(32, 8, 128, 16, pages, kv_dtype=torch.float8_e4m3fn)
    cache = PagedKVCache.allocate(spec, "cuda", k_scale=0.02, v_scale=0.015)
    n = cache.flat()[0].shape[0]
    for a in range(0, n, 8192):  # every slot random (through the quantizing store)
        idx = torch.arange(a, min(a + 8192, n), device="cuda")
        cache.store(idx, *(torch.randn(idx.shape[0], 8, 128, generator=gen, device="cuda").bfloat16() for _ in range(2)))
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=2048, max_num_pages=pages,
                                            buckets=(8, 32)))
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache),  # (write_kv: eagerly, below)
                          {"q": torch.zeros(32 * 4, 32, 128, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(1, 4))
    u = UNIT_ROUNDOFF[torch.bfloat16]
    shapes = {"decode": lambda B: ([1] * B, rng.integers(1, 3000, B)),
              "verify": lambda B: ([4] * B, rng.integers(5, 3000, B)),
              "prefill": lambda B: (rng.integers(1, 300, B), None),
              "extend": lambda B: (rng.integers(2, 200, B), rng.integers(300, 1500, B))}
    replayed = 0
    for i in range(16):
        mode = ["decode", "verify", "prefill", "extend"][i % 4]
        B = int(rng.integers(1, 40 if mode in ("decode", "verify") else 6))
        q_lens, kv = shapes[mode](B)
        kv_lens = q_lens if kv is None else kv
        plan = build_plan(random_batch(rng, q_lens, kv_lens, 16, pages), spec)
        step = pool.commit(plan)
        k, v = (torch.randn(plan.num_tokens, 8, 128, generator=gen, device="cuda").bfloat16() for _ in range(2))
        fi.write_kv(step, k, v, cache)
        q = torch.randn(plan.num_tokens, 32, 128, generator=gen, device="cuda").bfloat16()
        replay = graphs.serves(step)
        replayed += replay
        out = graphs(step, q=q) if replay else fi.run(step, q, cache)
        want = reference.run(plan, q.float(), cache)
        assert torch.isfinite(out).all(), (f"seed {seed}", i, mode)
        for r, (rel, abs_err, scale) in enumerate(request_errors(out, want, plan)):
            assert rel <= 3 * u and abs_err <= 9 * u * max(1.0, scale), (f"seed {seed}", i, mode, f"request {r}", rel, abs_err)
    assert replayed >= 4, f"seed {seed}"


@pytest.mark.parametrize("heads, q_lens", [((32, 8), (1, 4)), ((8, 8), (1,))], ids=["tensor-cores", "cuda-cores"])
def test_graph_wrappers_own_workspaces_hold_split_and_unsplit_plans(heads, q_lens):
    """graph_workspace_bytes at its extremes, on the production path: graph-mode wrappers of buckets 1..256 (each
    planning into an int workspace of that size, which FlashInfer's planner refuses to pass: it raises) commit steps
    of 2-token contexts and of 50k-token ones (split-KV wherever the batch leaves the GPU idle), at each q_len:
    every plan fits, its padded CTA count stays under the bound's premise, some plans split KV, and no two wrappers
    share a byte of workspace."""
    from mstar_attn.kernels._flashinfer_fast import MAX_CTAS_PER_SM, graph_workspace_bytes, padded_batch, split_kv

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(*heads, 128, 16, 256 * 3200)  # (planning only: no cache, no kernel runs)
    buckets = (1, 2, 8, 64, 256)
    pool = gpu_pool(spec, buckets=buckets, max_pages_per_request=3200)
    sched, kinds = pool.backend_state("flashinfer"), set()
    for B in buckets:
        for q_len in q_lens:
            for kv in (q_len + 1, 50000):
                pages = rng.permutation(spec.num_pages)[: B * -(-kv // 16)].astype(np.int32)
                batch = StepBatch.from_csr([q_len] * B, [kv] * B, np.arange(B + 1, dtype=np.int32) * -(-kv // 16), pages, 16)
                for _ in range(pool.num_slots):
                    step = pool.commit(build_plan(batch, spec))
                    w = step.scheduled[0]
                    assert w._int_workspace_buffer.numel() == graph_workspace_bytes(B, q_len, spec.gqa_group, heads[1], sched.sms)
                    bound = max(B * (q_len * spec.gqa_group + 1), MAX_CTAS_PER_SM * sched.sms // heads[1])
                    assert padded_batch(w) <= bound, (f"seed {seed}", B, q_len, kv, padded_batch(w), bound)  # (the bound's premise)
                    kinds.add(split_kv(w))
    assert True in kinds, f"seed {seed}: no plan split KV"  # (the largest grid: what the bound is for)
    assert disjoint(w._int_workspace_buffer for key, w in sched.wrappers.items() if key[0] == "graph"), f"seed {seed}"
