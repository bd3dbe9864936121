"""find_prefixes: groups of requests whose page lists start with the same run of whole cached pages."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import PlanError, StepBatch
from mstar_attn.metadata.cascade import find_prefixes


@st.composite
def families(draw):
    """Requests in prefix families (a shared run of pages, then pages of their own) and loners, shuffled."""
    ps = draw(st.sampled_from([1, 4, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(5000))
    reqs = []
    for _ in range(draw(st.integers(0, 4))):
        run = [free.pop() for _ in range(draw(st.integers(1, 6)))]
        for _ in range(draw(st.integers(1, 5))):
            own = [free.pop() for _ in range(draw(st.integers(1, 4)))]
            reqs.append(run + own)
    for _ in range(draw(st.integers(0, 4))):
        reqs.append([free.pop() for _ in range(draw(st.integers(1, 6)))])
    if not reqs:
        reqs.append([free.pop()])
    order = rng.permutation(len(reqs))
    pages = [reqs[i] for i in order]
    kv = np.array([len(p) * ps - int(rng.integers(0, ps)) for p in pages], np.int32)  # the last page may be partial
    q = np.array([int(rng.integers(1, max(2, min(int(k), 3 * ps)))) for k in kv], np.int32)
    q = np.minimum(q, kv)
    return ps, pages, q, kv, seed


@settings(max_examples=200, deadline=None)
@given(families())
def test_groups_are_exact_maximal_and_complete(case):
    ps, pages, q, kv, seed = case
    batch = StepBatch.from_pages(q, kv, pages, ps)
    c = find_prefixes(batch.page_indptr, batch.page_indices, q, kv, ps)
    full = (kv - q) // ps
    seen = set()
    for g in range(c.num_groups):
        members = c.members[c.members_indptr[g] : c.members_indptr[g + 1]]
        run = int(c.shared_pages[g])
        assert len(members) >= 2 and run >= 1, seed
        lead = [pages[i][:run] for i in members]
        assert all(x == lead[0] for x in lead), (seed, g)  # the same pages, in order
        assert all(full[i] >= run for i in members), (seed, g)  # whole pages of cached tokens only
        nxt = {pages[i][run] if full[i] > run else None for i in members}
        assert len(nxt) > 1 or None in nxt, (seed, g)  # maximal: page `run` is not shareable by all
        assert all(c.group_of[i] == g and c.suffix_page[i] == run for i in members), seed
        seen |= set(int(i) for i in members)
    cands = [i for i in range(len(pages)) if full[i] >= 1]
    for i in cands:  # complete: two requests that could share their first page are in one group
        for j in cands:
            if i < j and pages[i][0] == pages[j][0]:
                assert c.group_of[i] == c.group_of[j] >= 0, (seed, i, j)
    for i in set(range(len(pages))) - seen:
        assert c.group_of[i] == -1 and c.suffix_page[i] == 0, seed
    assert c.pages_saved() == sum((c.members_indptr[g + 1] - c.members_indptr[g] - 1) * c.shared_pages[g]
                                  for g in range(c.num_groups)), seed


def test_a_prefix_ending_mid_page_leaves_that_page_to_the_suffixes():
    """Three requests list the same 3 pages; one has cached only 2.5 of them: the group shares 2."""
    ps = 4
    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12]]
    kv, q = np.array([16, 16, 11]), np.array([1, 2, 1])  # cached: 15, 14, 10 tokens -> 3, 3, 2 whole pages
    b = StepBatch.from_pages(q, kv, pages, ps)
    c = find_prefixes(b.page_indptr, b.page_indices, q, kv, ps)
    assert c.num_groups == 1 and list(c.shared_pages) == [2] and list(c.suffix_page) == [2, 2, 2]
    longer = find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_pages=3)  # without the short one
    assert list(longer.members) == [0, 1] and list(longer.shared_pages) == [3] and list(longer.group_of) == [0, 0, -1]
    assert find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_requests=4).num_groups == 0
    with pytest.raises(PlanError, match="min_pages"):
        find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_pages=0)


@st.composite
def prefix_steps(draw):
    from tests.support.prefix_batches import prefix_batch

    ps = draw(st.sampled_from([1, 4, 16]))
    q_len = draw(st.sampled_from([1, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    families = draw(st.lists(st.integers(2, 5), min_size=0, max_size=3))
    loners = draw(st.integers(0 if families else 1, 3))
    q, kv, pages = prefix_batch(np.random.default_rng(seed), ps, q_len, 4000, families, loners)
    return ps, q, kv, pages, seed


@settings(max_examples=150, deadline=None)
@given(prefix_steps())
def test_level_arrays_split_each_list_into_its_shared_run_and_suffix(case):
    """plan.cascade (spec.cascade "always"): `query_order` is a permutation of the step's rows in level
    order (groups' members first, each group's rows contiguous); each request's shared run and
    suffix concatenate to its page list exactly; suffix lengths, last-page lengths and query
    ranges match the flat plan; shared runs are whole cached pages."""
    from mstar_attn import AttentionSpec, build_plan

    ps, q, kv, pages, seed = case
    spec = AttentionSpec(4, 2, 16, ps, 4000, dtype=torch.float32, backend="reference", cascade="always")
    plan = build_plan(StepBatch.from_pages(q, kv, pages, ps), spec)
    c = plan.cascade
    if c is None:
        assert find_prefixes(plan.kv_indptr, plan.kv_indices, q, kv, ps).num_groups == 0, seed
        return
    B, T = plan.batch_size, plan.num_tokens
    assert sorted(c.order.tolist()) == list(range(B)) and sorted(c.query_order.tolist()) == list(range(T)), seed
    group_of = c.prefixes.group_of
    assert list(group_of[c.order]) == sorted(group_of[c.order], key=lambda g: (g < 0, g)), seed  # groups, then loners
    assert c.member_queries == int(q[group_of >= 0].sum()) == c.shared_qo_indptr[-1], seed
    for j, i in enumerate(c.order):
        a, b = c.suffix_qo_indptr[j], c.suffix_qo_indptr[j + 1]
        assert list(c.query_order[a:b]) == list(range(plan.qo_indptr[i], plan.qo_indptr[i + 1])), (seed, i)
        suffix = list(c.suffix_kv_indices[c.suffix_kv_indptr[j] : c.suffix_kv_indptr[j + 1]])
        g = group_of[i]
        run = [] if g < 0 else list(c.shared_kv_indices[c.shared_kv_indptr[g] : c.shared_kv_indptr[g + 1]])
        assert run + suffix == list(pages[i][: -(-kv[i] // ps)]), (seed, i)
        assert c.suffix_kv_lens[j] == kv[i] - len(run) * ps >= q[i], (seed, i)
        assert c.suffix_last_page_len[j] == plan.kv_last_page_len[i], (seed, i)
        assert len(run) * ps <= kv[i] - q[i], (seed, i)  # only cached tokens are shared
        if g >= 0:
            lo, hi = c.shared_qo_indptr[g], c.shared_qo_indptr[g + 1]
            assert lo <= a and b <= hi, (seed, i)


def test_auto_picks_cascade_where_the_cost_model_says_it_wins():
    """spec.cascade "auto": 64 requests over an 8k-token shared prefix with 256 tokens each run as
    a cascade (the model estimates it ~3x faster); 8 requests over 512 shared tokens run flat; a
    step with no shared page runs flat; with backend "auto" a cascade step goes to flashinfer;
    "off" never cascades, and extend / prefill steps never do."""
    import attrs

    from mstar_attn import AttentionSpec, build_plan
    from mstar_attn.metadata.cascade import COST

    def family(B, shared, own, ps=16):
        lists = [list(range(shared // ps)) + list(range(10_000 + i * 100, 10_000 + i * 100 + own // ps)) for i in range(B)]
        return StepBatch.from_pages(np.ones(B, np.int32), np.full(B, shared + own, np.int32), lists, ps)

    spec = AttentionSpec(32, 8, 128, 16, 40_000, cascade="auto")
    big = build_plan(family(64, 8192, 256), spec)
    assert big.cascade is not None and big.cascade.num_groups == 1 and big.backend == "flashinfer"
    c = big.cascade.prefixes
    flat, cascade = COST.times(c, big.q_lens, big.kv_lens, 16, 32, 8, 128, 4096)
    assert flat > 2.5 * cascade
    assert build_plan(family(8, 512, 64), spec).cascade is None
    assert build_plan(family(64, 8192, 256), attrs.evolve(spec, backend="auto")).backend == "flashinfer"
    assert build_plan(family(64, 8192, 256), attrs.evolve(spec, cascade="off")).cascade is None
    lone = StepBatch.from_pages(np.ones(3, np.int32), np.full(3, 40, np.int32), [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 16)
    assert build_plan(lone, attrs.evolve(spec, cascade="always")).cascade is None
    verify = StepBatch.from_pages(np.full(64, 4, np.int32), np.full(64, 8192 + 256, np.int32),
                                  [list(range(512)) + list(range(10_000 + i * 100, 10_000 + i * 100 + 16)) for i in range(64)], 16)
    assert build_plan(verify, spec).cascade is None  # "auto": decode only (the model is measured on decode)
    assert build_plan(verify, attrs.evolve(spec, cascade="always")).cascade.num_groups == 1
    ext = StepBatch.from_pages(np.array([5, 9]), np.array([40, 44]), [[1, 2, 3], [1, 2, 4]], 16)  # shares page 1
    assert build_plan(ext, attrs.evolve(spec, cascade="always")).cascade is None  # extend: flat by rule


def test_cascade_spec_refusals_and_scratch_plans():
    import attrs

    from mstar_attn import AttentionSpec, LayerGroup
    from mstar_attn.metadata.plan import scratch_plan

    for kw, match in [(dict(cascade="yes"), "cascade: expected one of"),
                      (dict(cascade="auto", backend="flash_attn"), "backend flashinfer, reference or auto"),
                      (dict(cascade="auto", kv_dtype=torch.float8_e4m3fn), "cache"),
                      (dict(cascade="auto", groups=(LayerGroup("window", window=8),)), "full causal or non-causal")]:
        with pytest.raises(PlanError, match=match):
            AttentionSpec(32, 8, 128, 16, 100, **kw)
    spec = AttentionSpec(32, 8, 128, 16, 100, cascade="always", groups=(LayerGroup(), LayerGroup("window", window=8)),
                         layer_groups=(0, 1))
    assert spec.cascade_groups == (0,)
    for q_len in (1, 4):
        p = scratch_plan(spec, 8, q_len, cascade=True)
        assert p.cascade is not None and p.cascade.num_groups == 1 and p.cascade.member_queries == 8 * q_len
        assert set(p.kv_indices.tolist()) == {spec.scratch_page}
    assert scratch_plan(spec, 8).cascade is None
    with pytest.raises(PlanError, match="2\\+ requests"):
        scratch_plan(spec, 1, cascade=True)
    with pytest.raises(PlanError, match="runs on flashinfer or reference"):
        scratch_plan(attrs.evolve(spec, backend="auto"), 8, cascade=True, backend="flash_attn")
    with pytest.raises(PlanError, match="needs a spec with cascade on"):
        scratch_plan(attrs.evolve(spec, cascade="off"), 8, cascade=True)


def _flashinfer_chunk(pages: list[int], cap: int, min_chunk: int) -> int:
    """FlashInfer 0.7.2's KV chunk search (PrefillBinarySearchKVChunkSize, one query tile per request),
    written out from its scheduler.cuh: the smallest chunk >= min_chunk with sum(ceil(pages / chunk)) <= cap."""
    lo, hi = min_chunk, max(max(pages), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(-(-max(p, 1) // mid) for p in pages) > cap:
            lo = mid + 1
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_cost_model_partition_is_flashinfers_decode_grid(kv_heads):
    """CostModel.partition: the KV chunks per request are what FlashInfer's planner picks for a step of
    equal lists (short and long, page sizes 1 / 16 / 64) padded to the default bucket (padding
    requests over one page), and the wave factor follows from that grid's CTAs."""
    from mstar_attn.metadata.batch import DEFAULT_BUCKETS
    from mstar_attn.metadata.cascade import COST

    cap = COST.slots // kv_heads
    for ps in (1, 16, 64):
        for pages in (1, 3, 9, 40, 64 * cap):
            for B in range(1, 300):
                padded = next((b for b in DEFAULT_BUCKETS if b >= B), B)
                chunk = _flashinfer_chunk([pages] * B + [1] * (padded - B), cap, max(128 // ps, 1))
                n_fi = -(-pages // chunk)
                waves = -(-(B * n_fi * kv_heads) // COST.slots)
                n, w = COST.partition(B, kv_heads, pages, ps)
                assert (n, w) == (n_fi, pytest.approx(waves * COST.slots / (kv_heads * n_fi * B))), (ps, pages, B)


def test_regression_pin_cascade_auto_on_the_rows_it_was_fitted_on():
    """A regression pin, not an acceptance: the cost model was fitted on these rows (the crossover grid,
    benchmarks/results/cascade_h100.json, H100), and on every one build_plan with cascade "auto" picks a
    path no more than 3% slower than the faster one. A model change that breaks it fails here, not on
    the GPU. Held-out shapes (measured after the fit): benchmarks/results/cascade_heldout_h100.md."""
    import json
    from pathlib import Path

    from benchmarks.cascade_report import picks

    rows = json.loads((Path(__file__).parents[2] / "benchmarks/results/cascade_h100.json").read_text())["rows"]
    assert len(rows) == 130
    worst = max(picks(rows), key=lambda r: r["pick_over_best"])
    assert worst["pick_over_best"] <= 0.03, worst


def test_the_renamed_level_fields_keep_their_old_names_with_a_deprecation():
    """CascadePlan.rows / member_rows (before query_order / member_queries) still read, with a DeprecationWarning."""
    from mstar_attn import AttentionSpec, build_plan

    spec = AttentionSpec(4, 2, 16, 4, 400, dtype=torch.float32, backend="reference", cascade="always")
    shared = [0, 1, 2]  # three requests over one shared run of 3 pages, then a page each
    pages = [shared + [3], shared + [4], shared + [5]]
    c = build_plan(StepBatch.from_pages([1, 1, 1], [14, 14, 14], pages, 4), spec).cascade
    assert c is not None
    with pytest.warns(DeprecationWarning, match="use query_order"):
        assert c.rows is c.query_order
    with pytest.warns(DeprecationWarning, match="use member_queries"):
        assert c.member_rows == c.member_queries
