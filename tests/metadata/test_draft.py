"""build_round: K decode plans of a draft round from one batch, checked once, sharing the batch's pages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import AttentionSpec, LayerGroup, PlanError, StepBatch, build_plan
from mstar_attn.metadata.draft import MAX_DRAFT_STEPS, build_round, scratch_round

GROUPS = (LayerGroup(), LayerGroup("window", window=5), LayerGroup("window", window=33))


def _spec(ps: int, groups=GROUPS, **kw) -> AttentionSpec:
    return AttentionSpec(4, 2, 16, ps, 4096, groups=groups, layer_groups=tuple(range(len(groups))),
                         backend="reference", **kw)


@st.composite
def rounds(draw):
    ps = draw(st.sampled_from([1, 2, 4, 16]))
    k = draw(st.integers(1, 8))
    B = draw(st.integers(1, 6))
    kv0 = np.array(draw(st.lists(st.integers(1, 90), min_size=B, max_size=B)), np.int32)
    spare = draw(st.lists(st.integers(0, 2), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    counts = [-(-(int(n) + k - 1) // ps) + s for n, s in zip(kv0, spare)]
    ids = rng.permutation(4096)[: sum(counts)]
    pages = np.split(ids, np.cumsum(counts)[:-1])
    return ps, k, kv0, pages, seed


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_each_step_is_the_decode_step_it_stands_for(case):
    """Step j has kv_lens + j, position kv_len - 1 + j, the slot of that token; its lengths read through
    FlashInfer's formula ((pages - 1) * page_size + last_page_len) are kv_lens + j; a window group
    lists (for the whole round) at least what build_plan's step j reads, from a page boundary."""
    ps, k, kv0, pages, seed = case
    spec = _spec(ps)
    batch = StepBatch.from_pages(np.ones(len(kv0), np.int32), kv0, pages, ps)
    draft = build_round(batch, spec, k)
    assert draft.k == k and draft.batch_size == len(kv0), seed
    for j, plan in enumerate(draft.steps):
        want = build_plan(StepBatch.from_pages(np.ones(len(kv0), np.int32), kv0 + j, pages, ps), spec)
        assert plan.draft_step == j and plan.mode.value == "decode", seed
        for field in ("kv_lens", "positions", "slot_mapping", "qo_indptr", "q_lens"):
            assert np.array_equal(getattr(plan, field), getattr(want, field)), (seed, j, field)
        assert plan.max_kv_len == want.max_kv_len and plan.num_tokens == want.num_tokens, (seed, j)
        for g, (gp, wg) in enumerate(zip(plan.groups, want.groups)):
            n = np.diff(gp.kv_indptr)
            assert np.array_equal((n - 1) * ps + gp.kv_last_page_len, gp.kv_lens), (seed, j, g)
            start = np.zeros_like(kv0) if gp.kv_start is None else gp.kv_start
            assert np.array_equal(start + gp.kv_lens, kv0 + j), (seed, j, g)
            w_start = np.zeros_like(kv0) if wg.kv_start is None else wg.kv_start
            assert (start <= w_start).all() and (start % ps == 0).all(), (seed, j, g)
            for i in range(len(kv0)):  # the pages step j reads are the round's, from the same logical page on
                mine = gp.kv_indices[gp.kv_indptr[i] : gp.kv_indptr[i + 1]]
                theirs = wg.kv_indices[wg.kv_indptr[i] : wg.kv_indptr[i + 1]]
                skip = (w_start[i] - start[i]) // ps
                assert np.array_equal(mine[skip : skip + len(theirs)], theirs), (seed, j, g, i)
                assert np.array_equal(mine, pages[i][start[i] // ps : -(-(kv0[i] + k - 1) // ps)]), (seed, j, g, i)


@settings(max_examples=50, deadline=None)
@given(rounds())
def test_steps_share_the_page_arrays(case):
    """Every step holds the same page arrays (one object per group), read-only; exact lists are the batch's own."""
    ps, k, kv0, pages, seed = case
    batch = StepBatch.from_pages(np.ones(len(kv0), np.int32), kv0, pages, ps)
    draft = build_round(batch, _spec(ps), k)
    first = draft.steps[0]
    for plan in draft.steps[1:]:
        assert plan.kv_indices is first.kv_indices and plan.kv_indptr is first.kv_indptr, seed
        for gp, g0 in zip(plan.groups, first.groups):
            assert gp.kv_indices is g0.kv_indices and gp.kv_indptr is g0.kv_indptr, seed
    assert not first.kv_indices.flags.writeable and not first.kv_last_page_len.flags.writeable, seed
    exact = all(len(p) == -(-(int(n) + k - 1) // ps) for p, n in zip(pages, kv0))
    assert exact == np.shares_memory(first.kv_indices, batch.page_indices), seed


def test_scratch_round_reads_and_writes_only_the_scratch_page():
    spec = _spec(4)
    draft = scratch_round(spec, 3, 6)
    for plan in draft.steps:
        assert (plan.kv_indices == spec.scratch_page).all()
        assert (plan.slot_mapping // 4 == spec.scratch_page).all()


def _batch(kv0, pages, ps=4, q=None):
    return StepBatch.from_pages(np.ones(len(kv0), np.int32) if q is None else q, kv0, pages, ps)


@pytest.mark.parametrize("make, match", [
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 3]], q=[1, 2]), s, 2), r"q_lens\[1\].*request 1"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2]]), s, 2), r"page_indptr: request 1 lists 1 pages.*fewer than the round's 2 tokens need.*\(request 1\)"),
    (lambda s: build_round(_batch([4, 3], [[0], [2, 3]]), s, 2), r"page_indptr: request 0 lists 1 pages.*\(request 0\)"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [0, 3]]), s, 2), r"page 0 is written"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 3]]), s, 0), r"k: "),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 3]]), s, MAX_DRAFT_STEPS + 1), r"k: .*at most"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 4096]]), s, 2), r"request 1 lists page 4096, the scratch page"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 3]], ps=8), s, 2), r"page_size"),
    (lambda s: build_round(_batch([3, 5], [[0, 1], [2, 3]]).kv_lens, s, 2), r"batch: "),
])
def test_bad_rounds_name_the_field_and_request(make, match):
    with pytest.raises(PlanError, match=match):
        make(_spec(4))


def test_a_read_shared_prefix_may_be_listed_twice_but_not_a_written_page():
    """Page 0 (full, read by both) may be shared; a page the round writes may not."""
    spec = _spec(4)
    build_round(_batch([6, 6], [[0, 1], [0, 3]]), spec, 3)
    with pytest.raises(PlanError, match="page 1 is written"):
        build_round(_batch([6, 6], [[0, 1], [0, 1]]), spec, 3)


def test_own_page_and_cross_groups_are_refused():
    spec = _spec(4, groups=(LayerGroup(), LayerGroup("window", window=8, own_pages=True)))
    with pytest.raises(PlanError, match="own page list"):
        build_round(_batch([3], [[0, 1]]), spec, 2)


def test_bad_flags_and_own_lists_are_refused():
    spec = _spec(4)
    batch = _batch([3, 5], [[0, 1], [2, 3]])
    with pytest.raises(PlanError, match="check_ownership"):
        build_round(batch, spec, 2, check_ownership=None)
    with pytest.raises(PlanError, match="batch_size"):
        scratch_round(spec, 0, 2)
    with pytest.raises(PlanError, match="k: .*at most"):
        scratch_round(spec, 2, MAX_DRAFT_STEPS + 1)
    own = _spec(4, groups=(LayerGroup(), LayerGroup("window", window=8, own_pages=True)))
    with pytest.raises(PlanError, match="own page list"):
        scratch_round(own, 2, 2)


def test_a_block_table_batch_lists_the_rounds_pages_from_its_table():
    """from_block_table cuts each list at kv_lens; a round reads kv_lens + k - 1: taken from the table."""
    spec = _spec(4)
    table = np.array([[0, 1, 2, 9], [3, 4, 5, 6]])
    draft = build_round(StepBatch.from_block_table([1, 1], [3, 6], table, 4), spec, 4)
    assert np.array_equal(draft.steps[0].kv_indices, [0, 1, 3, 4, 5]) and np.array_equal(draft.steps[-1].kv_lens, [6, 9])
    with pytest.raises(PlanError, match=r"block_table\[1\].*request 1"):
        build_round(StepBatch.from_block_table([1, 1], [3, 14], table, 4), spec, 4)
