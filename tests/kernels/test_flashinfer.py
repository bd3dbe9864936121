"""FlashInfer backend through GraphBufferPool, eager and replayed, against the reference (GPU only)."""

import inspect

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, Mode, PagedKVCache, build_plan
from mstar_attn.kernels import reference
from tests.helpers import (
    GPU_GROUPS, gpu_pool, make_step, many_steps, no_sync_on_the_step_path, random_batch, rel_err,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402

GROUPS = GPU_GROUPS
# bf16 inputs on both sides; the kernel rounds P to bf16 before P@V and the output to bf16
# (each ~2^-9 relative), the reference works in float32: norm-relative error well under 1e-2.
TOL = 1e-2


def gpu_step(seed, q_lens, kv_lens, page_size=16, groups=GROUPS, heads=(32, 8), head_dim=128, soft_cap=0.0):
    return make_step(seed, q_lens, kv_lens, page_size, torch.bfloat16, groups=groups, heads=heads, head_dim=head_dim,
                     device="cuda", backend="flashinfer", soft_cap=soft_cap, write=False)


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


@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa4-tensor-cores", "mha-cuda-cores"])
@pytest.mark.parametrize(
    "q_lens, kv_lens, mode",
    [
        ([1] * 5, [1, 17, 64, 300, 4100], Mode.DECODE),
        ([5, 33, 200], [5, 33, 200], Mode.PREFILL),
        ([7, 20], [90, 21], Mode.EXTEND),
        ([1, 30, 1, 4], [50, 30, 2, 100], Mode.MIXED),
        ([4, 4, 4], [5, 40, 129], Mode.VERIFY),
    ],
)
def test_every_mode_matches_the_reference(q_lens, kv_lens, mode, heads):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, q_lens, kv_lens, heads=heads, soft_cap=20.0 if heads[0] == 8 else 0.0)
    assert plan.mode is mode
    pool = gpu_pool(spec)
    step = pool.commit(plan)
    fi.write_kv(step, k_new, v_new, cache)
    ref_cache = type(cache)(cache.k.clone(), cache.v.clone())
    reference.write_kv(plan, k_new, v_new, ref_cache)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
    for g in range(len(spec.groups)):
        out = fi.run(step, q, cache, group=g)
        want = reference.run(plan, q, cache, group=g)
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert rel_err(out, want) < TOL, (seed, mode, spec.groups[g])


def test_ragged_prefill_matches_the_reference():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, [64, 300, 7], [64, 300, 7])
    spec = attrs.evolve(spec, backend="flashinfer_ragged")
    plan = attrs.evolve(plan, spec=spec, backend="flashinfer_ragged")
    pool = gpu_pool(spec)
    step = pool.commit(plan)
    assert isinstance(step.scheduled[0], flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
    fi.write_kv(step, k_new, v_new, cache)
    for g in range(len(spec.groups)):
        out = fi.run(step, q, cache, group=g, k=k_new, v=v_new)
        assert rel_err(out, reference.run(plan, q, cache, group=g)) < TOL


def test_hundreds_of_steps_eager_and_replayed():
    """Changing batch sizes (across buckets and past the largest), lengths and pages, 200 steps:
    decode and verify (q_len 4, captured) replayed, other modes eager."""
    many_steps(fi.run, "flashinfer", TOL)


def test_double_buffering_lets_the_host_run_ahead():
    """Commit step N+1 while the GPU is still busy before step N: two slots never stall, one does.

    Both runs stay correct (a slot is reused only after its copies ran), so removing the
    second buffer shows up as a stall, not as wrong output.
    """
    seed = int(np.random.SeedSequence().entropy % 2**31)
    spec, plan_a, cache, q_a, *_ = gpu_step(seed, [1] * 8, list(range(100, 108)), groups=GROUPS[:1])
    plan_b = build_plan(random_batch(np.random.default_rng(seed + 1), [1] * 8, list(range(107, 99, -1)), 16, spec.num_pages), spec)
    for slots, stalls in [(2, 0), (1, 1)]:
        pool = gpu_pool(spec, num_slots=slots)
        for _ in range(2):  # warm up the wrappers
            fi.run(pool.commit(plan_a), q_a, cache)
        torch.cuda.synchronize()
        pool.stalls = 0
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the commits
        out_a = fi.run(pool.commit(plan_a), q_a, cache)
        out_b = fi.run(pool.commit(plan_b), q_a, cache)
        torch.cuda.synchronize()
        assert pool.stalls == stalls
        assert rel_err(out_a, reference.run(plan_a, q_a, cache)) < TOL
        assert rel_err(out_b, reference.run(plan_b, q_a, cache)) < TOL


def test_no_device_sync_on_the_step_path():
    no_sync_on_the_step_path(fi, gpu_step, int(np.random.SeedSequence().entropy % 2**31))


@pytest.mark.parametrize("heads, q_len", [((32, 8), 1), ((8, 8), 1), ((32, 8), 4)], ids=["tensor-cores", "cuda-cores", "verify"])
def test_fast_replan_matches_public_plan(heads, q_len):
    """The internals _flashinfer_fast reads: the fast re-plan must leave a graph-mode wrapper in
    the state public plan() leaves it: the same plan info and a bit-identical output over the
    same cache, on changing lengths. (The int workspace itself is not compared: the CUDA-core
    planner leaves unwritten gaps in it.) Fails loudly when FlashInfer moves them."""
    from mstar_attn.kernels._flashinfer_fast import VERSIONS

    assert flashinfer.__version__ in VERSIONS, f"re-check _flashinfer_fast against FlashInfer {flashinfer.__version__}"
    rng = np.random.default_rng()
    B, ps = 16, 16
    spec = AttentionSpec(*heads, 128, ps, 512)
    cache = PagedKVCache(torch.randn(spec.num_pages, ps, heads[1], 128, device="cuda", dtype=torch.bfloat16),
                         torch.randn(spec.num_pages, ps, heads[1], 128, device="cuda", dtype=torch.bfloat16))
    pools = [gpu_pool(spec, buckets=(B,)), gpu_pool(spec, buckets=(B,))]
    for pool in pools:
        pool.scheduler_for("flashinfer").use_fast = pool is pools[1]
    first = build_plan(random_batch(rng, [q_len] * B, [q_len + 1] * B, ps, spec.num_pages), spec)
    for pool in pools:
        pool.commit(first, slot=0)  # public plan() in both
    for i in range(6):
        kv = rng.integers(q_len + 1, 6 * ps, B)
        plan = build_plan(random_batch(rng, [q_len] * B, kv, ps, spec.num_pages), spec)
        public, fast = (pool.commit(plan, slot=0) for pool in pools)
        wp, wf = public.scheduled[0], fast.scheduled[0]
        assert wp is not wf and (0, 0, B, q_len) in pools[1].scheduler_for("flashinfer").fast
        assert (0, 0, B, q_len) not in pools[0].scheduler_for("flashinfer").fast
        assert list(wp._plan_info) == list(wf._plan_info), i
        q = torch.randn(B * q_len, heads[0], 128, device="cuda", dtype=torch.bfloat16)
        out_p, out_f = fi.run(public, q, cache), fi.run(fast, q, cache)
        assert torch.equal(out_p, out_f), i
        assert rel_err(out_f, reference.run(plan, q, cache)) < TOL, i


def test_replay_follows_new_plans_on_the_public_plan_path():
    """Without the pinned fast path (another FlashInfer version) every bucketed commit re-plans the
    same graph-mode wrapper through public plan(), so captured graphs still follow each commit."""
    rng = np.random.default_rng()
    spec = AttentionSpec(32, 8, 128, 16, 2000)
    cache = PagedKVCache(torch.randn(2000, 16, 8, 128, device="cuda", dtype=torch.bfloat16),
                         torch.randn(2000, 16, 8, 128, device="cuda", dtype=torch.bfloat16))
    pool = GraphBufferPool(spec, max_batch_size=16, max_num_tokens=256, max_num_pages=2000, buckets=(8, 16))
    pool.scheduler_for("flashinfer").use_fast = False
    graphs = DecodeGraphs(pool, lambda step, x: fi.run(step, x["q"], cache), {"q": torch.zeros(16, 32, 128, device="cuda", dtype=torch.bfloat16)})
    graphs.capture()
    for i in range(20):
        B = int(rng.integers(1, 17))
        plan = build_plan(random_batch(rng, np.ones(B, np.int32), rng.integers(1, 900, B), 16, 2000), spec)
        step = pool.commit(plan)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
        assert graphs.serves(step)
        assert rel_err(graphs(step, q=q), reference.run(plan, q, cache)) < TOL, i
    assert not pool.scheduler_for("flashinfer").fast
