"""DecodeGraphs: what capture refuses (CPU), capture while requests hold KV, and the stream contract (GPU)."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PlanError, PoolLimits, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from tests.helpers import GPU_GROUPS, assert_close_per_request, fresh_seed, marked, random_batch, random_cache, spec_for


def cpu_graphs(groups=(LayerGroup(),), rows=64):
    spec = spec_for(page_size=4, num_pages=64, groups=groups)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=16, max_num_tokens=64, max_num_pages=64,
                                            buckets=(4, 8)), device="cpu")
    return DecodeGraphs(pool, lambda step, x: x["q"], {"q": torch.zeros(rows, 4, 16)})


@pytest.mark.parametrize("kwargs, match", [
    (dict(buckets=(3,)), r"buckets \[3\] are not the pool's buckets \(4, 8\)"),
    (dict(q_lens=(17,)), r"q_len 17 is not bucketed"),
    (dict(q_lens=(0,)), r"q_len 0 is not bucketed"),
    (dict(backends=("flashinfer_ragged",)), r"does not serve decode steps over a paged cache"),
    (dict(backends=("nope",)), r"backend 'nope'"),
    (dict(q_lens=(8,)), r"inputs \['q'\] have fewer than 64 rows"),
    (dict(), r"CUDA graphs need a CUDA pool"),
])
def test_capture_refuses_what_could_never_replay(kwargs, match):
    with pytest.raises(PlanError, match=match):
        cpu_graphs(rows=8 * 7).capture(**kwargs)


def test_verify_graphs_need_causal_groups():
    with pytest.raises(PlanError, match="q_len 4 is not bucketed"):
        cpu_graphs(groups=(LayerGroup(), LayerGroup("noncausal"))).capture(q_lens=(4,))


# ---------------------------------------------------------------------------------------------
# GPU

def _gpu_backends():
    if not torch.cuda.is_available():
        return []
    out = []
    for name, module in (("flashinfer", "flashinfer"), ("flash_attn", "flash_attn.cute")):
        try:
            __import__(module)
            out.append(name)
        except ImportError:
            pass
    return out


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_capture_after_serving_leaves_every_requests_kv_untouched(backend):
    """Capture warms up and records on scratch-page steps: capturing (write_kv + run, every bucket,
    decode and verify, both slots) while requests hold KV leaves every page but the scratch page
    bit-identical, and the steps served after capture match the reference per request."""
    from mstar_attn import kernels

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, 16, 2000, groups=GPU_GROUPS[:2], backend=backend)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=32, max_num_tokens=512, max_num_pages=2000,
                                            buckets=(1, 8, 32)))
    plans = [build_plan(random_batch(rng, [1] * 6, rng.integers(2, 900, 6), 16, 2000), spec) for _ in range(2)]
    for plan in plans:  # serving has begun: these requests' KV is in the cache
        step = pool.commit(plan)
        kernels.write_kv(step, torch.randn(6, 8, 128, device="cuda", dtype=torch.bfloat16),
                         torch.randn(6, 8, 128, device="cuda", dtype=torch.bfloat16), cache)
    torch.cuda.synchronize()
    before = (cache.k[: spec.num_pages].clone(), cache.v[: spec.num_pages].clone())
    x = {n: torch.randn(32 * 4, h, 128, device="cuda", dtype=torch.bfloat16) for n, h in (("q", 32), ("k", 8), ("v", 8))}

    def layer(step, x):  # rows first: [rows, groups, heads, head_dim]
        kernels.write_kv(step, x["k"], x["v"], cache)
        return torch.stack([kernels.run(step, x["q"], cache, group=g) for g in range(2)], dim=1)

    graphs = DecodeGraphs(pool, layer, x)
    graphs.capture(q_lens=(1, 4))
    torch.cuda.synchronize()
    assert torch.equal(cache.k[: spec.num_pages], before[0]) and torch.equal(cache.v[: spec.num_pages], before[1]), \
        f"seed {seed}: capture wrote a request's page"
    for plan in plans:
        step = pool.commit(plan)
        q = torch.randn(6, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = cache.k.flatten(0, 1)[torch.tensor(plan.slot_mapping, device="cuda")], cache.v.flatten(0, 1)[torch.tensor(plan.slot_mapping, device="cuda")]
        out = graphs(step, q=q, k=k, v=v)  # rewrites the same K/V, then attends
        for g in range(2):
            assert_close_per_request(out[:, g], reference.run(plan, q.float(), cache, group=g), plan, spec.dtype, (f"seed {seed}", g))


@gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_commits_on_a_side_stream(backend):
    """The stream contract. Commits run on a side stream (and every third on the compute stream
    itself) while the compute stream is held back by a GPU sleep; the compute stream waits for each
    side-stream step (step.wait()) and runs it. The commit after next reuses a step's slot: its
    copy must wait on the GPU for the compute stream's queued kernels, or the earlier step would
    read the later step's pages. Every output matches the reference per request; a step not waited
    for is refused by name."""
    from mstar_attn import kernels

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, 16, 8000, groups=GPU_GROUPS[:2], backend=backend)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=1024, max_num_pages=8000,
                                            buckets=(8, 64)))
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    plans = [build_plan(random_batch(rng, [1] * int(b), rng.integers(2, 1500, int(b)), 16, 8000), spec)
             for b in rng.integers(1, 64, 9)]
    qs = [torch.randn(p.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16) for p in plans]
    for p, q in zip(plans, qs):  # warm up (JIT) outside the timed-out region
        kernels.run(marked(pool.commit(p), cache), q, cache)  # (random K/V already at every slot)
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)  # the compute stream is busy for ~0.15 s
    outs = []
    for i, (p, q) in enumerate(zip(plans, qs)):
        if i % 3 == 2:  # a commit on the compute stream itself: it runs there, no wait needed, and the
            step = marked(pool.commit(p), cache)  # side-stream commit that next reuses its slot must wait for it
        else:
            step = marked(pool.commit(p, stream=side), cache)
            with pytest.raises(PlanError, match="side stream"):
                kernels.run(step, q, cache)
            step.wait()  # the current (compute) stream waits for the commit's copies
        outs.append([kernels.run(step, q, cache, group=g) for g in range(2)])
    with pytest.raises(PlanError, match="one compute stream"):  # the other slot's step runs on the compute stream
        pool.commit(plans[0], stream=side).wait(torch.cuda.Stream())
    with pytest.raises(PlanError, match="torch.cuda.Stream"):
        pool.commit(plans[0], stream="side")
    torch.cuda.synchronize()
    for i, (p, q, out) in enumerate(zip(plans, qs, outs)):
        for g in range(2):
            assert_close_per_request(out[g], reference.run(p, q.float(), cache, group=g), p, spec.dtype, (f"seed {seed}", i, g))
    assert compute == torch.cuda.current_stream()


def test_token_trees_capture_up_to_max_tree_nodes():
    """q_lens past MAX_VERIFY_Q_LEN are refused without trees=True, or past the pool's max_tree_nodes; within it the
    capture gets as far as the device check (a CPU pool)."""
    spec = spec_for(page_size=4, num_pages=64)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=16, max_num_tokens=64, max_num_pages=64, buckets=(4, 8),
                                            max_tree_nodes=40), device="cpu")
    graphs = DecodeGraphs(pool, lambda step, x: x["q"], {"q": torch.zeros(8 * 64, 4, 16)})
    with pytest.raises(PlanError, match="q_len 40 is not bucketed"):
        graphs.capture(q_lens=(40,))
    with pytest.raises(PlanError, match="q_len 41 is not bucketed .* this pool 40"):
        graphs.capture(q_lens=(41,), trees=True)
    with pytest.raises(PlanError, match=r"q_lens \[40\] are token-tree steps only, and none of the backends \['flash_attn'\]"):
        graphs.capture(q_lens=(40,), trees=True, backends=("flash_attn",))
    with pytest.raises(PlanError, match="CUDA graphs need a CUDA pool"):
        graphs.capture(q_lens=(40,), trees=True)
