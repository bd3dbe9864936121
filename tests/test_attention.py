"""mstar_attn/attention.py on the CPU reference backend: an engine loop through `Attention` (prefill, then
decode steps by pages and over the page table, two layer groups with a window) against the reference over
an independently written cache, per request; and its misuse errors."""

import numpy as np
import pytest
import torch

from mstar_attn import Attention, LayerGroup, PagedKVCache, PlanError, PoolLimits, StepBatch, StepRows, build_plan
from mstar_attn.kernels import reference
from tests.helpers import assert_close_per_request, fresh_seed, spec_for

GROUPS = (LayerGroup(), LayerGroup("window", window=6))
LIMITS = PoolLimits(max_batch_size=8, max_num_tokens=128, max_num_pages=200, buckets=(2, 4), max_requests=8,
                    max_pages_per_request=32)


def test_an_engine_loop_through_attention_matches_the_reference_per_request():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS, layer_groups=(0, 1, 0))
    attn = Attention(spec, LIMITS, device="cpu")
    oracle = [PagedKVCache.allocate(spec, "cpu") for _ in range(3)]  # (written by the reference, from the plans)
    B = 3
    prompt = rng.integers(3, 12, B).astype(np.int32)
    free = list(rng.permutation(200).astype(np.int32))
    rows = np.arange(B, dtype=np.int32)
    for r, n in zip(rows, prompt):
        attn.table.assign(int(r), [free.pop() for _ in range(-(-(int(n) + 12) // 4))])  # (room for the decode steps)
    pages = [attn.table.pages(int(r)) for r in rows]
    kv = prompt.copy()
    for i in range(8):
        if i == 0:
            batch = StepBatch.from_pages(prompt, kv, [p[: -(-int(k) // 4)] for p, k in zip(pages, kv)], 4)
        else:
            kv = kv + 1
            batch = StepRows.decode(rows, kv) if i % 2 else StepBatch.from_pages(
                np.ones(B, np.int32), kv, [p[: -(-int(k) // 4)] for p, k in zip(pages, kv)], 4)
        step = attn.step(batch)
        plan = build_plan(StepBatch.from_pages(step.plan.q_lens, kv, [p[: -(-int(k) // 4)] for p, k in zip(pages, kv)], 4),
                          spec)  # (the same step by pages, for the reference)
        T = plan.num_tokens
        for layer in range(3):
            q = torch.randn(T, 4, 16, generator=gen)
            k, v = (torch.randn(T, 2, 16, generator=gen) for _ in range(2))
            out = attn.forward(step, layer, q, k, v)
            g = spec.group_of(layer)
            reference.write_kv(plan, k, v, oracle[layer], g)
            assert_close_per_request(out, reference.run(plan, q, oracle[layer], g), plan, torch.float32,
                                     (f"seed {seed}", i, layer))


def test_attention_misuse_is_a_plan_error_naming_it():
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS, layer_groups=(0, 1))
    with pytest.raises(PlanError, match="layer: 2 is past spec.layer_groups"):
        Attention(spec, LIMITS, device="cpu", num_layers=3)
    with pytest.raises(PlanError, match="caches: 1 caches for 2 layers"):
        Attention(spec, LIMITS, device="cpu", caches=[PagedKVCache.allocate(spec)])
    other = spec_for(page_size=8, num_pages=200, groups=GROUPS, layer_groups=(0, 1))
    with pytest.raises(PlanError, match=r"caches\[0\]"):
        Attention(spec, LIMITS, device="cpu", caches=[PagedKVCache.allocate(other) for _ in range(2)])
    attn = Attention(spec, LIMITS, device="cpu")
    step = attn.step(StepBatch.from_pages([2], [2], [[5]], 4))
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(PlanError, match="layer index 0..1"):
        attn.forward(step, 2, q, k, k)
    with pytest.raises(PlanError, match="both k and v"):
        attn.forward(step, 0, q, k)
    with pytest.raises(PlanError, match="stores this step's new K/V: give its k and v"):
        attn.forward(step, 0, q)  # (it would attend over stale slots)
    with pytest.raises(PlanError, match=r"caches\[1\]: the same cache as caches\[0\]"):
        one = PagedKVCache.allocate(spec)
        Attention(spec, LIMITS, device="cpu", caches=[one, one])
    fp8 = spec_for(page_size=4, num_pages=200, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(PlanError, match="k_scale / v_scale"):
        Attention(fp8, LIMITS, device="cpu")
    with pytest.raises(PlanError, match="StepBatch or StepRows"):
        attn.step(build_plan(StepBatch.from_pages([2], [2], [[5]], 4), spec))
    with pytest.raises(PlanError, match="nothing is captured"):
        attn.replay(step, q=q)


@pytest.mark.gpu
def test_attention_on_the_gpu_eager_and_replayed_matches_the_reference():
    """FlashInfer through Attention on the H100: a prefill step eagerly, then StepRows decode steps over
    the page table replayed through a captured one-layer decode forward (their commits' device work
    inside the graph), every request against the reference over the same cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    from mstar_attn import AttentionSpec

    spec = AttentionSpec(32, 8, 128, 16, 512)
    attn = Attention(spec, PoolLimits(max_batch_size=8, max_num_tokens=512, max_num_pages=512, buckets=(8,),
                                      max_requests=8, max_pages_per_request=64), num_layers=1, warm=True)
    B = 6
    rows = rng.permutation(8)[:B].astype(np.int32)
    free = list(rng.permutation(512).astype(np.int32))
    kv = rng.integers(20, 60, B).astype(np.int32)
    for r, n in zip(rows, kv):
        attn.table.assign(int(r), [free.pop() for _ in range(-(-(int(n) + 16) // 16))])
    pages = [attn.table.pages(int(r)) for r in rows]

    def by_pages(q_lens, kv):
        return build_plan(StepBatch.from_pages(q_lens, kv, [p[: -(-int(k) // 16)] for p, k in zip(pages, kv)], 16), spec)

    def randn(n, h):
        return torch.randn(n, h, 128, generator=gen, device="cuda").bfloat16()

    plan = by_pages(kv, kv)  # (the prompts, eagerly)
    step = attn.step(StepBatch.from_pages(kv, kv, [p[: -(-int(k) // 16)] for p, k in zip(pages, kv)], 16))
    q, k, v = randn(plan.num_tokens, 32), randn(plan.num_tokens, 8), randn(plan.num_tokens, 8)
    out = attn.forward(step, 0, q, k, v)
    assert_close_per_request(out, reference.run(plan, q.float(), attn.caches[0]), plan, torch.bfloat16, f"seed {seed}")
    static = {name: torch.zeros(8, h, 128, device="cuda", dtype=torch.bfloat16) for name, h in (("q", 32), ("k", 8), ("v", 8))}
    attn.capture(lambda s, x: attn.forward(s, 0, x["q"], x["k"], x["v"]), static)
    for i in range(6):
        kv = kv + 1
        step = attn.step(StepRows.decode(rows, kv))
        q, k, v = randn(B, 32), randn(B, 8), randn(B, 8)
        out = attn.replay(step, q=q, k=k, v=v)
        plan = by_pages(np.ones(B, np.int32), kv)
        assert_close_per_request(out, reference.run(plan, q.float(), attn.caches[0]), plan, torch.bfloat16,
                                 f"seed {seed}, step {i}")
    assert len(attn.graphs.prepared) >= 1, f"seed {seed}"  # (decode steps replayed with their commit's work)
