"""The reference backend against a naive per-sequence float64 softmax, on the CPU."""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, Kind, LayerGroup, PagedKVCache, PlanError, StepBatch, build_plan
from mstar_attn.kernels import reference
from tests.helpers import (
    assert_close_per_request, fresh_seed, make_step, naive_attention, random_batch, random_cache, request_errors, spec_for,
)
from tests.support.exact import exact_attention

GROUPS = (LayerGroup(), LayerGroup("window", window=37), LayerGroup("noncausal"))

# ||out - ref|| / ||ref|| bounds. float32 inputs: the reference accumulates in float32 over at
# most ~5k keys, far under 1e-5. bf16/fp16: the output is rounded once to the dtype (relative
# error <= 2^-9 for bf16, 2^-12 for fp16 per element); inputs are identical on both sides.
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def check_against_naive(seed, q_lens, kv_lens, page_size, dtype=torch.float32, **kw):
    kw.setdefault("groups", GROUPS)
    spec, plan, cache, q, k_seqs, v_seqs = make_step(seed, q_lens, kv_lens, page_size, dtype, **kw)[:6]
    for g, group in enumerate(spec.groups):
        out = reference.run(plan, q, cache, group=g)
        assert out.dtype == dtype and out.shape == q.shape
        want = torch.cat([
            naive_attention(q[plan.qo_indptr[i] : plan.qo_indptr[i + 1]], k_seqs[i], v_seqs[i], kind=group.kind,
                            window=group.window, scale=spec.sm_scale, soft_cap=spec.soft_cap)
            for i in range(plan.batch_size)
        ])
        for i, (err, _, _) in enumerate(request_errors(out, want, plan)):  # per request: no request hides in the batch
            assert err < TOL[dtype], f"seed {seed}, group {group}, request {i}: relative error {err:.2e}"
    return plan


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(
    "name, q_lens, kv_lens",
    [
        ("decode", [1] * 4, [1, 17, 64, 200]),
        ("prefill", [5, 33, 64], [5, 33, 64]),
        ("extend", [7, 20], [90, 21]),
        ("mixed", [1, 30, 1, 4], [50, 30, 2, 100]),
        ("verify", [4, 4, 4], [5, 40, 129]),
    ],
)
def test_modes_against_naive(name, q_lens, kv_lens, page_size):
    plan = check_against_naive(fresh_seed(), q_lens, kv_lens, page_size)
    assert plan.mode.value == name


def test_batch_of_128_decodes():
    seed = fresh_seed()
    kv = np.random.default_rng(seed).integers(1, 300, 128).tolist()
    check_against_naive(seed, [1] * 128, kv, 16, groups=(LayerGroup(), LayerGroup("window", window=64)))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_long_context(page_size):
    check_against_naive(fresh_seed(), [1, 9], [4100, 5000], page_size)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_soft_cap(dtype):
    check_against_naive(fresh_seed(), [1, 12, 3], [70, 12, 40], 16, dtype=dtype, soft_cap=5.0, heads=(8, 2))


def test_kv_length_one():
    check_against_naive(fresh_seed(), [1, 1], [1, 1], 16)


def test_write_kv_touches_only_the_steps_slots():
    spec, plan, cache, *_ = make_step(fresh_seed(), [1, 3], [10, 20], 4, groups=GROUPS)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    k = torch.randn(plan.num_tokens, spec.num_kv_heads, spec.head_dim)
    v = torch.randn_like(k)
    reference.write_kv(plan, k, v, cache)
    k_flat, v_flat = cache.flat()
    slots = torch.tensor(plan.slot_mapping)
    assert torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v)
    changed = (cache.k != before_k).flatten(0, 1).any(-1).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(slots.tolist())
    keep = torch.ones(k_flat.shape[0], dtype=torch.bool)
    keep[slots] = False
    assert torch.equal(k_flat[keep], before_k.flatten(0, 1)[keep])
    assert torch.equal(v_flat[keep], before_v.flatten(0, 1)[keep])


def test_layer_groups_map_layers_to_plans():
    spec = spec_for(groups=GROUPS, layer_groups=(0, 1, 1, 2))
    plan = build_plan(random_batch(np.random.default_rng(0), [1], [50], 16, spec.num_pages), spec)
    assert [plan.group_for_layer(i).group.kind for i in range(4)] == [Kind.CAUSAL, Kind.WINDOW, Kind.WINDOW, Kind.NONCAUSAL]


def test_per_request_check_sees_one_dropped_key():
    """The negative control of assert_close_per_request: drop the newest key of a 1,000-token
    request in a batch of short ones (what an off-by-one in a kernel's kv length does). The
    batch-wide norm barely moves; the per-request check fails that request, and only it.
    (Measured over 12 seeds: the dropped key moves a 1,000-token request by 2.1e-2..5.7e-2, a
    4,100-token one by 1.0e-2..2.3e-2, against the bf16 bound of 7.8e-3.)"""
    seed = fresh_seed()
    spec, plan, cache, q, *_ = make_step(seed, [1] * 5, [1000, 3, 9, 17, 30], 16, heads=(32, 8), head_dim=128)
    want = reference.run(plan, q, cache)
    g = plan.groups[0]
    short = type(g)(g.group, g.kv_indptr, g.kv_indices, g.kv_last_page_len, g.kv_lens - np.array([1, 0, 0, 0, 0], np.int32))
    from attrs import evolve

    broken = reference._attend(evolve(plan, groups=(short,)), q, cache, 0, g.kv_indices)  # request 0 misses its own (newest) key
    batch_wide = ((broken - want).norm() / want.norm()).item()
    per_request = request_errors(broken, want, plan)
    assert batch_wide < 1e-2, (f"seed {seed}", batch_wide)  # a batch-wide check at the old tolerance passes
    assert per_request[0][0] > 2 * 2.0**-8, (f"seed {seed}", per_request[0])  # past the bf16 bound (2u)
    assert all(e[0] == 0 for e in per_request[1:])
    with pytest.raises(AssertionError, match="request 0 of 5"):
        assert_close_per_request(broken, want, plan, torch.bfloat16, f"seed {seed}")


@pytest.mark.parametrize("page_size, window", [(1, 8), (4, 13), (16, 40)])
def test_own_page_lists_match_the_exact_attention(page_size, window):
    """A hybrid model over 25 steps: the window group writes and reads its own list, which gives
    back pages the window has passed (reused by later requests, stale K/V and all); both groups
    match the exact attention of each request's true K/V."""
    from tests.support.group_pages import HybridTrace

    seed = fresh_seed()
    groups = (LayerGroup(), LayerGroup("window", window=window, own_pages=True))
    spec = AttentionSpec(4, 2, 16, page_size, 3000, dtype=torch.float32, groups=groups, layer_groups=(0, 1),
                         soft_cap=3.0, backend="reference")
    trace = HybridTrace(spec, seed, max_batch=8, max_prompt=60)
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    for i in range(25):
        plan = trace.step(i)
        k, v = trace.new_kv(plan)
        q = trace.query(plan)
        for call in (lambda: reference.write_kv(plan, k, v, caches[1]), lambda: reference.run(plan, q, caches[1])):
            with pytest.raises(PlanError, match="pass group=spec.group_of"):
                call()
        with pytest.raises(PlanError, match="the cache serves layer group 1, the call names group 0"):
            reference.write_kv(plan, k, v, caches[1], group=0)  # the shared list's slots in the window layer's cache
        for g in range(2):
            reference.write_kv(plan, k, v, caches[g], group=g)
            out = reference.run(plan, q, caches[g], group=g)
            for r, (err, _, _) in enumerate(request_errors(out, trace.oracle(plan, q, g), plan)):
                assert err < TOL[torch.float32], (f"seed {seed}", i, plan.mode, g, f"request {r}", err)
        trace.advance(plan)
    assert trace.given_back > 0, f"seed {seed}"  # the window group gave pages back mid-request (reused later)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_cross_attention_matches_the_exact_attention(page_size):
    """An encoder-decoder over 20 steps: each request's encoder K/V (1 to 2,000 tokens) stored once
    through write_kv(group=cross) at its first step, then read non-causally by every decoder query."""
    from tests.support.cross_pages import GROUPS, CrossTrace, serve

    seed = fresh_seed()
    spec = AttentionSpec(4, 2, 16, page_size, 16000, dtype=torch.float32, groups=GROUPS, layer_groups=(0, 1),
                         backend="reference")
    trace = CrossTrace(spec, seed, max_batch=6, max_encoder=2000)
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    ran = serve(trace, None, reference, caches, 20, seed)
    assert any(stored for *_, stored in ran) and ran.get(("decode", False, False)), (f"seed {seed}", ran)
    for i in range(20, 60):  # a step that stores no encoder K/V refuses a cross write
        plan = trace.step(i)
        if not plan.groups[1].slot_mapping.shape[0]:
            break
        trace.new_kv(plan), trace.advance(plan)
    k = torch.randn(plan.num_tokens, 2, 16)
    with pytest.raises(PlanError, match="layer group 1 is cross attention and this step stores no encoder K/V"):
        reference.write_kv(plan, k, k, caches[1], group=1)


@pytest.mark.parametrize("kind, soft_cap, sinks", [("causal", 0.0, False), ("noncausal", 0.0, False), ("causal", 5.0, False),
                                                   ("causal", 0.0, True), ("noncausal", 5.0, True)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_cascade_plans_equal_the_flat_attention_per_request(kind, soft_cap, sinks, page_size, q_len):
    """A cascade plan (spec.cascade "always": each prefix group's shared pages once, each request's
    suffix, merged by log-sum-exp, read from the plan's level arrays) equals the flat plan of the
    same step per request (float64), decode and verify: several prefix groups, loners, prefixes
    ending mid-page; a window group beside it reads flat in the same step. With attention sinks, the
    sinks join once, after the levels merged."""
    from tests.support.prefix_batches import prefix_batch

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q, kv, pages = prefix_batch(rng, page_size, q_len, 3000)
    groups = (LayerGroup(kind, sinks=sinks), LayerGroup("window", window=int(rng.integers(1, 40)), sinks=sinks))
    specs = [spec_for(page_size=page_size, num_pages=3000, dtype=torch.float64, groups=groups, soft_cap=soft_cap,
                      cascade=c) for c in ("always", "off")]
    batch = StepBatch.from_pages(q, kv, pages, page_size)
    plan, flat = (build_plan(batch, s) for s in specs)
    assert flat.cascade is None and plan.cascade is not None and specs[0].cascade_groups == (0,), seed
    c = plan.cascade
    assert c.num_groups >= 3 and (c.prefixes.group_of == -1).sum() >= 2, seed
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(*(torch.randn(specs[0].cache_shape, generator=gen, dtype=torch.float64) for _ in range(2)))
    qt = torch.randn(plan.num_tokens, 4, 16, generator=gen, dtype=torch.float64)
    s = 3 * torch.randn(4, generator=gen) if sinks else None
    for g in range(2):
        got, want = reference.run(plan, qt, cache, group=g, sinks=s), reference.run(flat, qt, cache, group=g, sinks=s)
        for i in range(plan.batch_size):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            err = ((got[a:b] - want[a:b]).norm() / want[a:b].norm()).item()
            assert err < 1e-12, (f"seed {seed}", f"group {g}", f"request {i}", f"prefix group {c.prefixes.group_of[i]}", err)


def test_cascade_without_the_merge_is_caught(monkeypatch):
    """The equality above fails for a cascade that drops the shared level (no merge): every member
    of a prefix group is off by far more than float64 rounding."""
    import mstar_attn.kernels.reference as ref
    from tests.support.prefix_batches import prefix_batch

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q, kv, pages = prefix_batch(rng, 4, 1, 500)
    spec = spec_for(page_size=4, num_pages=500, dtype=torch.float64, cascade="always")
    batch = StepBatch.from_pages(q, kv, pages, 4)
    plan, flat = build_plan(batch, spec), build_plan(batch, attrs.evolve(spec, cascade="off"))
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(*(torch.randn(spec.cache_shape, generator=gen, dtype=torch.float64) for _ in range(2)))
    qt = torch.randn(plan.num_tokens, 4, 16, generator=gen, dtype=torch.float64)
    want = reference.run(flat, qt, cache)
    assert (reference.run(plan, qt, cache) - want).abs().max() < 1e-12, seed
    monkeypatch.setattr(ref, "merge_states", lambda o1, l1, o2, l2: (o2, l2))
    broken = reference.run(plan, qt, cache)
    for i in np.flatnonzero(plan.cascade.prefixes.group_of >= 0):
        assert (broken[i] - want[i]).norm() / want[i].norm() > 1e-3, (seed, int(i))


def test_merge_states_of_a_split_key_set_is_the_whole_attention():
    from mstar_attn.kernels.reference import _partial, merge_states

    gen = torch.Generator().manual_seed(0)
    spec = spec_for(dtype=torch.float64)
    q, k, v = (torch.randn(n, 4, 16, generator=gen, dtype=torch.float64) for n in (3, 20, 20))
    whole, lse = _partial(spec, q, k, v, None)
    merged, lse2 = merge_states(*_partial(spec, q, k[:7], v[:7], None), *_partial(spec, q, k[7:], v[7:], None))
    assert torch.allclose(merged, whole, rtol=1e-12, atol=1e-12) and torch.allclose(lse2, lse, rtol=1e-12)
    empty = torch.full((3, 4), float("-inf"), dtype=torch.float64)  # one side without keys: the other one
    assert torch.equal(merge_states(torch.zeros_like(whole), empty, whole, lse)[0], whole)


SINK_GROUPS = tuple(attrs.evolve(g, sinks=True) for g in GROUPS)


def _sink_step(seed, soft_cap, page_size):
    """A random mixed step over the sink groups (float32), its cache filled, and large random sinks: N(0, 3^2)
    per head, so some heads' sinks take most of the softmax and others almost none."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 7))
    kv = rng.integers(1, 120, B)
    q = np.minimum(kv, rng.choice([1, 1, 4, 30], B))
    made = make_step(seed, q.tolist(), kv.tolist(), page_size, groups=SINK_GROUPS, soft_cap=soft_cap, heads=(6, 2))
    sinks = 3 * torch.randn(6, generator=torch.Generator().manual_seed(seed + 1))
    return made, sinks


def _sink_want(made, g, sinks):
    spec, plan, _, q, k_seqs, v_seqs = made[:6]
    group = spec.groups[g]
    return torch.cat([
        exact_attention(q[plan.qo_indptr[i] : plan.qo_indptr[i + 1]], k_seqs[i], v_seqs[i], scale=spec.sm_scale,
                        soft_cap=spec.soft_cap, causal=group.causal, window=group.window or 0, sinks=sinks)
        for i in range(plan.batch_size)])


@pytest.mark.parametrize("soft_cap", [0.0, 4.0])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", range(4))
def test_sinks_equal_a_softmax_with_a_sink_column(soft_cap, page_size, case):
    """Attention sinks in the reference (o * sigmoid(lse - sink) after the softmax) against the direct
    form (one more column per head in a float64 softmax, its probability dropped: gpt-oss's), per
    request, causal, window and non-causal groups, with and without soft-capping, to float32 rounding.
    Negative controls: the reference with the sinks zeroed, and the direct form without sinks, are
    far off."""
    seed = fresh_seed()
    made, sinks = _sink_step(seed, soft_cap, page_size)
    spec, plan, cache, q = made[:4]
    for g in range(len(spec.groups)):
        want = _sink_want(made, g, sinks)
        got = reference.run(plan, q, cache, group=g, sinks=sinks)
        for i, (err, _, _) in enumerate(request_errors(got, want, plan)):
            assert err < TOL[torch.float32], f"seed {seed}, group {g}, request {i}: relative error {err:.2e}"
        zeroed = reference.run(plan, q, cache, group=g, sinks=torch.zeros_like(sinks))
        assert max(e for e, _, _ in request_errors(zeroed, want, plan)) > 100 * TOL[torch.float32], f"seed {seed}"
        dropped = _sink_want(made, g, None)
        assert max(e for e, _, _ in request_errors(got, dropped, plan)) > 100 * TOL[torch.float32], f"seed {seed}"


def test_sinks_are_refused_where_missing_misshapen_or_unexpected():
    """A sink group run without its sinks, with sinks of the wrong dtype, shape or device, and sinks given to a
    group that has none: PlanErrors naming the group and the numbers."""
    made, sinks = _sink_step(fresh_seed(), 0.0, 4)
    plan, cache, q = made[1], made[2], made[3]
    with pytest.raises(PlanError, match=r"layer group 0 has attention sinks .* float32 tensor \[6\]"):
        reference.run(plan, q, cache, group=0)
    with pytest.raises(PlanError, match=r"sinks must be float32 \[6\] .* got torch.float64 \(6,\)"):
        reference.run(plan, q, cache, group=0, sinks=sinks.double())
    with pytest.raises(PlanError, match=r"got torch.float32 \(4,\)"):
        reference.run(plan, q, cache, group=0, sinks=sinks[:4])
    plain = make_step(fresh_seed(), [1, 3], [5, 9], 4)
    with pytest.raises(PlanError, match="sinks given, but layer group 0 has none"):
        reference.run(plain[1], plain[3], plain[2], group=0, sinks=sinks[:4])

