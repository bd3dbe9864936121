"""mstar_attn/attention.py: an engine loop through per-layer `Attention` objects on the CPU reference
backend (a prefill step, then decode steps by pages and over the page table, two layer groups with a
window) against the reference over an independently written cache, per request; its misuse errors;
and on the H100, FlashInfer eager and replayed through a captured forward."""

import numpy as np
import pytest
import torch

from mstar_attn import (Attention, GraphBufferPool, LayerGroup, PagedKVCache, PlanError, PoolLimits, StepBatch,
                        StepRows, build_plan)
from mstar_attn.kernels import reference
from tests.helpers import assert_close_per_request, fresh_seed, spec_for

GROUPS = (LayerGroup(), LayerGroup("window", window=6))
LIMITS = PoolLimits(max_batch_size=8, max_num_tokens=128, max_num_pages=200, buckets=(2, 4), max_requests=8,
                    max_pages_per_request=32)


def _lists(pages, kv, ps):
    return [p[: -(-int(k) // ps)] for p, k in zip(pages, kv)]


def test_an_engine_loop_through_attention_layers_matches_the_reference_per_request():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS, layer_groups=(0, 1, 0))
    pool = GraphBufferPool(spec, LIMITS, device="cpu")
    layers = Attention.for_model(spec, "cpu")
    assert [a.group for a in layers] == [0, 1, 0] and len({id(a.cache) for a in layers}) == 3, seed
    oracle = [PagedKVCache.allocate(spec, "cpu") for _ in range(3)]  # (written by the reference, from the plans)
    B = 3
    kv = rng.integers(3, 12, B).astype(np.int32)
    free = list(rng.permutation(200).astype(np.int32))
    rows = np.arange(B, dtype=np.int32)
    for r, n in zip(rows, kv):
        pool.table.assign(int(r), [free.pop() for _ in range(-(-(int(n) + 12) // 4))])  # (room for the decode steps)
    pages = [pool.table.pages(int(r)) for r in rows]
    for i in range(8):
        q_lens = kv if i == 0 else np.ones(B, np.int32)
        kv = kv if i == 0 else kv + 1
        plan = build_plan(StepBatch.from_pages(q_lens, kv, _lists(pages, kv, 4), 4), spec)  # (by pages: the reference's)
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec) if i % 2 else plan, defer=True)
        for layer, attn in enumerate(layers):
            q = torch.randn(plan.num_tokens, 4, 16, generator=gen)
            k, v = (torch.randn(plan.num_tokens, 2, 16, generator=gen) for _ in range(2))
            out = attn.forward(q, k, v, step)
            reference.write_kv(plan, k, v, oracle[layer], attn.group)
            assert_close_per_request(out, reference.run(plan, q, oracle[layer], attn.group), plan, torch.float32,
                                     (f"seed {seed}", i, layer))


def test_attention_misuse_is_a_plan_error_naming_it():
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS, layer_groups=(0, 1))
    with pytest.raises(PlanError, match="layer: 2 is past spec.layer_groups"):
        Attention.for_model(spec, "cpu", num_layers=3)
    with pytest.raises(PlanError, match="cache: expected a PagedKVCache"):
        Attention(spec, 0, None)
    other = spec_for(page_size=8, num_pages=200, groups=GROUPS, layer_groups=(0, 1))
    with pytest.raises(PlanError, match="layer 0: cache"):
        Attention(spec, 0, PagedKVCache.allocate(other))
    with pytest.raises(PlanError, match="serves layer group 1"):
        Attention(spec, 0, PagedKVCache.allocate(spec, group=1))
    pool = GraphBufferPool(spec, LIMITS, device="cpu")
    attn = Attention.for_model(spec, "cpu")[0]
    step = pool.commit(build_plan(StepBatch.from_pages([2], [2], [[5]], 4), spec))
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(PlanError, match="both k and v"):
        attn.forward(q, k, None, step)
    with pytest.raises(PlanError, match="stores this step's new K/V: give its k and v"):
        attn.forward(q, None, None, step)  # (it would attend over slots nothing wrote)
    fp8 = spec_for(page_size=4, num_pages=20, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert Attention.for_model(fp8, "cpu", k_scale=0.5)[0].cache.k_scale == 0.5


def test_a_layer_with_attention_sinks_passes_its_own_and_refuses_misuse():
    """Each layer of a sink group holds its own sinks and run reads them: forward equals the reference
    given that layer's sinks, per request, and differs from it given another layer's. A sink layer
    without sinks, sinks of another shape, or sinks on a layer whose group has none: PlanErrors."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    groups = (LayerGroup(sinks=True), LayerGroup("window", window=6))
    spec = spec_for(page_size=4, num_pages=200, groups=groups, layer_groups=(0, 1, 0))
    sinks = [3 * torch.randn(4, generator=gen), None, 3 * torch.randn(4, generator=gen)]
    layers = Attention.for_model(spec, "cpu", sinks=sinks)
    assert torch.equal(layers[0].sinks, sinks[0]) and layers[1].sinks is None, seed
    plan = build_plan(StepBatch.from_pages([5, 1], [5, 9], [[1, 2], [3, 4, 5]], 4), spec)
    for layer, attn in enumerate(layers):
        q = torch.randn(plan.num_tokens, 4, 16, generator=gen)
        k, v = (torch.randn(plan.num_tokens, 2, 16, generator=gen) for _ in range(2))
        out = attn.forward(q, k, v, plan)
        want = reference.run(plan, q, attn.cache, attn.group, sinks=sinks[layer])
        assert_close_per_request(out, want, plan, torch.float32, (f"seed {seed}", layer))
        if layer != 1:
            other = reference.run(plan, q, attn.cache, attn.group, sinks=sinks[2 - layer])
            assert (out - other).abs().max() > 1e-3, (f"seed {seed}", layer)
    with pytest.raises(PlanError, match=r"layer 0's group 0 has attention sinks .* float32 tensor \[4\]"):
        Attention(spec, 0, PagedKVCache.allocate(spec, group=0))
    with pytest.raises(PlanError, match=r"layer 2: expected float32 \[4\] on cpu, got torch.float32 \(3,\)"):
        Attention(spec, 2, PagedKVCache.allocate(spec, group=0), sinks=torch.zeros(3))
    with pytest.raises(PlanError, match="layer 1's group 1 has no attention sinks"):
        Attention(spec, 1, PagedKVCache.allocate(spec, group=1), sinks=torch.zeros(4))
    with pytest.raises(PlanError, match=r"sinks: expected one entry per layer \(3\), got 2"):
        Attention.for_model(spec, "cpu", sinks=sinks[:2])


@pytest.mark.gpu
def test_attention_on_the_gpu_eager_and_replayed_matches_the_reference():
    """FlashInfer through Attention on the H100: a prefill step eagerly, then StepRows decode steps over
    the page table replayed through a captured one-layer forward (their commits' device work inside the
    graph), every request against the reference over the same cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from mstar_attn import AttentionSpec, DecodeGraphs
    from mstar_attn.warmup import warmup

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, 16, 512)
    warmup(spec)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=512, max_num_pages=512, buckets=(8,),
                                            max_requests=8, max_pages_per_request=64))
    attn = Attention.for_model(spec, "cuda", num_layers=1)[0]
    B = 6
    rows = rng.permutation(8)[:B].astype(np.int32)
    free = list(rng.permutation(512).astype(np.int32))
    kv = rng.integers(20, 60, B).astype(np.int32)
    for r, n in zip(rows, kv):
        pool.table.assign(int(r), [free.pop() for _ in range(-(-(int(n) + 16) // 16))])
    pages = [pool.table.pages(int(r)) for r in rows]

    def randn(n, h):
        return torch.randn(n, h, 128, generator=gen, device="cuda").bfloat16()

    plan = build_plan(StepBatch.from_pages(kv, kv, _lists(pages, kv, 16), 16), spec)  # (the prompts, eagerly)
    step = pool.commit(plan, defer=True)
    q, k, v = randn(plan.num_tokens, 32), randn(plan.num_tokens, 8), randn(plan.num_tokens, 8)
    out = attn.forward(q, k, v, step)
    assert_close_per_request(out, reference.run(plan, q.float(), attn.cache), plan, torch.bfloat16, f"seed {seed}")
    static = {name: torch.zeros(8, h, 128, device="cuda", dtype=torch.bfloat16) for name, h in (("q", 32), ("k", 8), ("v", 8))}
    graphs = DecodeGraphs(pool, lambda s, x: attn.forward(x["q"], x["k"], x["v"], s), static)
    graphs.capture()
    for i in range(6):
        kv = kv + 1
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
        q, k, v = randn(B, 32), randn(B, 8), randn(B, 8)
        out = graphs(step, q=q, k=k, v=v)
        plan = build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, _lists(pages, kv, 16), 16), spec)
        assert_close_per_request(out, reference.run(plan, q.float(), attn.cache), plan, torch.bfloat16,
                                 f"seed {seed}, step {i}")
