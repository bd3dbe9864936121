"""Shared-prefix (cascade) steps on the FlashInfer backend, eager and replayed, per request against
the reference over the flat plan of the same step and against FlashInfer's flat path (GPU only).

Bound. The flat kernels stay within 2u per request of the float32 reference (tests/helpers.py). A
cascade request's output is w1 o1 + w2 o2 over the two levels, each level's output rounded to
the dtype (<= u |o_l|) and the merge rounded once more (<= u |o|); the probabilities are rounded
once per key, as in the flat kernel (<= u). The level outputs are averages over fewer keys than
the whole, so larger: for keys of random values |o_l| ~ n_l^-1/2 while |o| ~ n^-1/2, and
w_l ~ n_l / n, so w1 |o1| + w2 |o2| <= sqrt(2) |o|. Per request: u + sqrt(2) u + u < 3.5u in norm
(3u used: the three roundings are independent, their RMS sum is ~1.9u), and elementwise 12u
max(1, max |o|). A dropped key of a 1k-token request moves it by 2e-2 or more (6u = 2.3e-2 for bf16).
"""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PoolLimits, StepBatch, build_plan
from mstar_attn.kernels import reference
from tests.helpers import smoke_first, assert_close_per_request, attend_filled, fresh_seed, marked, random_cache, replay_or_run
from tests.support.prefix_batches import prefix_batch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402



def check_cascade(out, want, plan, context, units=3.0):
    """Every request within `units` u of `want` (the bound above), naming its prefix group on failure."""
    groups = plan.cascade.prefixes.group_of.tolist()
    assert_close_per_request(out, want, plan, torch.bfloat16, (*context, f"prefix group of each request: {groups}"), units)


@pytest.mark.parametrize("page_size, kind, sinks", smoke_first([(1, "causal", False), (16, "noncausal", False),
                                                                 (64, "causal", False), (16, "causal", True)],
                                                                lambda c: c == (16, "noncausal", False)))
def test_cascade_steps_eager_and_replayed(page_size, kind, sinks):
    """Random decode and verify steps of several prefix families (2-9 members, prefixes of 1 page to
    2k tokens, some ending mid-page), loners, batches inside the captured buckets (replayed) and past
    them (eager): the cascade group per request against the reference over the flat plan and against
    FlashInfer's flat path; a window group beside it reads flat in the same step. With `sinks`, both
    groups have attention sinks (N(0, 3^2) per head), applied once after the levels merged."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    ps, num_pages = page_size, 40000 // page_size
    groups = (LayerGroup(kind, sinks=sinks), LayerGroup("window", window=int(rng.integers(8, 500)), sinks=sinks))
    sink_logits = (3 * torch.randn(32, generator=torch.Generator().manual_seed(seed))).cuda() if sinks else None
    spec = AttentionSpec(32, 8, 128, ps, num_pages, groups=groups, layer_groups=(0, 1), cascade="always")
    flat_spec = AttentionSpec(32, 8, 128, ps, num_pages, groups=groups, layer_groups=(0, 1))
    cache = random_cache(spec, seed)
    # max_num_pages bounds the page entries one step lists (shared pages once per member)
    pool, flat_pool = (GraphBufferPool(s, PoolLimits(max_batch_size=64, max_num_tokens=512,
                                                     max_num_pages=200_000 // ps, buckets=(8, 32)))
                       for s in (spec, flat_spec))
    verify = all(g.causal for g in groups)
    def run_fi(st, q, c, group):
        return fi.run(st, q, c, group=group, sinks=sink_logits)

    graphs = [DecodeGraphs(pool, attend_filled(run_fi, cache, g),
                           {"q": torch.zeros(32 * 4, 32, 128, device="cuda", dtype=torch.bfloat16)}) for g in range(2)]
    for gr in graphs:
        gr.capture(q_lens=(1, 4) if verify else (1,))
    ran = []
    for i in range(10):
        q_len = 4 if i % 2 else 1
        big = i in (4, 5)  # past the largest bucket: eager
        families = [int(rng.integers(2, 10)) for _ in range(int(rng.integers(1, 4)) if not big else 5)]
        loners = int(rng.integers(0, 4)) + (12 if big else 0)
        if big:  # (past the largest bucket, 32, whatever the families' sizes: an eager step)
            loners = max(loners, 33 - sum(families))
        while sum(families) + loners > 32 and not big:
            families.pop()
        q, kv, pages = prefix_batch(rng, ps, q_len, num_pages, families, loners, max_prefix_pages=2048 // ps,
                                    max_own_pages=300 // ps + 1)
        batch = StepBatch.from_pages(q, kv, pages, ps)
        plan, flat = build_plan(batch, spec), build_plan(batch, flat_spec)
        assert plan.cascade is not None and plan.cascade.num_groups == len(families), (seed, i)
        step, flat_step = marked(pool.commit(plan), cache), marked(flat_pool.commit(flat), cache)  # (random K/V at every slot)
        qt = torch.randn(plan.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
        for g in range(2):
            ctx = (f"seed {seed}", f"step {i}", plan.mode.value, f"group {g}", f"B {plan.batch_size}")
            out, replayed = replay_or_run(graphs[g], step, {"q": qt}, lambda st, x: fi.run(st, x["q"], cache, group=g, sinks=sink_logits),
                                          ctx)
            want = reference.run(flat, qt.float(), cache, group=g, sinks=sink_logits)
            flat_out = fi.run(flat_step, qt, cache, group=g, sinks=sink_logits)
            assert_close_per_request(flat_out, want, plan, torch.bfloat16, ctx + ("flat",))
            if g == 0:
                check_cascade(out, want, plan, ctx)
                check_cascade(out, flat_out, plan, ctx + ("vs flat",), units=5.0)
            else:  # the window group is not a cascade group: the flat kernel, the flat bound
                assert_close_per_request(out, want, plan, torch.bfloat16, ctx)
            ran.append((plan.mode.value, replayed))
    assert ("decode", True) in ran and any(not r for _, r in ran), ran
    if verify:
        assert ("verify", True) in ran, ran


def test_the_largest_verify_bucket_captures_and_replays():
    """Bucket 256 at q_len 16 (4,096 query rows): the shared level's graph-mode plan fits its float
    workspace (kernels/_cascade.shared_workspace_bytes), and a replayed step of 8 prefix families
    and loners matches the reference over the flat plan per request."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(32, 8, 128, 16, 20000, cascade="always")
    flat_spec = AttentionSpec(32, 8, 128, 16, 20000)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=4096, max_num_pages=20000,
                                            buckets=(256,)))
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache),
                          {"q": torch.zeros(256 * 16, 32, 128, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(16,))
    q, kv, pages = prefix_batch(rng, 16, 16, 20000, [int(rng.integers(20, 30)) for _ in range(8)], 10,
                                max_prefix_pages=32, max_own_pages=4)
    batch = StepBatch.from_pages(q, kv, pages, 16)
    plan, flat = build_plan(batch, spec), build_plan(batch, flat_spec)
    step = marked(pool.commit(plan), cache)  # (random K/V already at every slot)
    assert graphs.serves(step) and step.padded_batch_size == 256 and plan.cascade.num_groups == 8, seed
    qt = torch.randn(plan.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    out, replayed = replay_or_run(graphs, step, {"q": qt}, lambda st, x: fi.run(st, x["q"], cache), (f"seed {seed}",))
    assert replayed
    check_cascade(out, reference.run(flat, qt.float(), cache), plan, (f"seed {seed}",))
