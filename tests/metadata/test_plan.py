"""Property tests of build_plan (no GPU) and every PlanError case."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar_attn import LayerGroup, Mode, PlanError, StepBatch, build_plan
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, scratch_plan
from tests.helpers import draw_lengths, fresh_seed, random_batch, random_pages, spec_for


@st.composite
def steps(draw):
    """A random valid step: page size, per-request (q_len, prefix), spare pages, window groups."""
    ps, q, kv = draw_lengths(draw, [1, 2, 16, 64], 12, 40, 300)
    window = draw(st.integers(1, 100))
    extra = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31))
    need = sum((k + ps - 1) // ps for k in kv) + extra * len(q)
    spec = spec_for(page_size=ps, num_pages=need + draw(st.integers(0, 50)),
                    groups=(LayerGroup(), LayerGroup("window", window=window), LayerGroup("noncausal")))
    batch = random_batch(np.random.default_rng(seed), q, kv, ps, spec.num_pages, extra)
    return spec, batch


def pages_of(batch, i):
    return batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]


@given(steps())
def test_plan_indices_match_the_batch(step):
    spec, batch = step
    plan = build_plan(batch, spec)
    ps, q, kv = spec.page_size, batch.q_lens, batch.kv_lens
    need = (kv + ps - 1) // ps
    assert plan.batch_size == len(q) and plan.num_tokens == q.sum()
    assert np.array_equal(np.diff(plan.qo_indptr), q) and plan.qo_indptr[0] == 0
    assert np.array_equal(np.diff(plan.kv_indptr), need) and plan.kv_indptr[0] == 0
    assert np.array_equal(plan.kv_indices, np.concatenate([pages_of(batch, i)[: need[i]] for i in range(len(q))]))
    assert ((plan.kv_last_page_len >= 1) & (plan.kv_last_page_len <= ps)).all()
    assert np.array_equal((need - 1) * ps + plan.kv_last_page_len, kv)
    assert plan.max_q_len == q.max() and plan.max_kv_len == kv.max()
    t = 0
    for i in range(len(q)):
        for j in range(q[i]):
            pos = kv[i] - q[i] + j
            assert plan.positions[t] == pos
            assert plan.slot_mapping[t] == pages_of(batch, i)[pos // ps] * ps + pos % ps
            t += 1


@given(steps())
def test_window_group_trims_whole_invisible_pages(step):
    spec, batch = step
    plan = build_plan(batch, spec)
    ps, W = spec.page_size, spec.groups[1].window
    full, win, nc = plan.groups
    assert full.kv_start is None and nc.kv_start is None and not nc.group.causal
    for i in range(plan.batch_size):
        first_visible = max(0, int(batch.kv_lens[i] - batch.q_lens[i]) - (W - 1))
        start = int(win.kv_start[i])
        assert start % ps == 0 and start <= first_visible < start + ps  # nothing visible dropped, no whole page kept in vain
        pages = win.kv_indices[win.kv_indptr[i] : win.kv_indptr[i + 1]]
        need = (int(batch.kv_lens[i]) + ps - 1) // ps
        assert np.array_equal(pages, pages_of(batch, i)[start // ps : need])
        assert win.kv_lens[i] == batch.kv_lens[i] - start
        assert win.kv_last_page_len[i] == plan.kv_last_page_len[i]


@given(steps())
def test_plans_are_immutable_and_deterministic(step):
    spec, batch = step
    plan = build_plan(batch, spec)
    again = build_plan(StepBatch.from_csr(batch.q_lens.tolist(), batch.kv_lens.tolist(), batch.page_indptr.tolist(),
                                          batch.page_indices.tolist(), batch.page_size), spec)
    assert plan == again
    for field in attrs.fields(type(plan)):
        value = getattr(plan, field.name)
        if isinstance(value, np.ndarray):
            assert not value.flags.writeable, field.name
            with pytest.raises(ValueError):
                value[...] = 0
    for g in plan.groups:
        for a in (g.kv_indptr, g.kv_indices, g.kv_last_page_len, g.kv_lens):
            assert not a.flags.writeable
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.num_tokens = 0


def test_the_plan_does_not_alias_the_engines_arrays():
    kv = np.array([20, 5], np.int32)
    indptr, indices = np.array([0, 2, 3], np.int32), np.array([4, 7, 1], np.int32)
    plan = build_plan(StepBatch.from_csr([1, 1], kv, indptr, indices, 16), spec_for())
    kv[:] = 99
    indices[:] = 0
    assert plan.kv_lens.tolist() == [20, 5] and plan.kv_indices.tolist() == [4, 7, 1]


def test_block_table_and_csr_give_the_same_plan():
    rng = np.random.default_rng(1)
    kv, q = np.array([33, 1, 17, 64]), np.array([1, 1, 17, 3])
    pages = random_pages(rng, kv, 16, 100, extra=2)
    table = np.full((4, max(map(len, pages))), -1, np.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = p
    spec = spec_for(num_pages=100)
    from_table = build_plan(StepBatch.from_block_table(q, kv, table, 16), spec)
    from_csr = build_plan(StepBatch.from_pages(q, kv, pages, 16), spec)
    assert attrs.evolve(from_table, block_table=None) == from_csr
    assert np.array_equal(from_table.block_table, table)


@pytest.mark.parametrize(
    "q, kv, mode",
    [
        ([1, 1, 1], [5, 9, 1], Mode.DECODE),
        ([4, 7], [4, 7], Mode.PREFILL),
        ([1, 7], [1, 7], Mode.PREFILL),
        ([3, 3], [10, 4], Mode.VERIFY),
        ([16, 16], [40, 17], Mode.VERIFY),  # the longest verify
        ([17, 17], [40, 18], Mode.EXTEND),  # a uniform chunk past MAX_VERIFY_Q_LEN is chunked prefill
        ([512], [2048], Mode.EXTEND),  # one request continuing a chunked prefill
        ([1, 5], [9, 5], Mode.MIXED),
        ([2, 5], [9, 5], Mode.EXTEND),
        ([3, 3], [3, 10], Mode.EXTEND),
    ],
)
def test_mode_is_the_steps_shape(q, kv, mode):
    """Mode by structure (see Mode's doc): uniform q_len up to MAX_VERIFY_Q_LEN over a cached
    prefix is VERIFY (what pools bucket); longer uniform chunks are EXTEND."""
    assert MAX_VERIFY_Q_LEN == 16
    plan = build_plan(random_batch(np.random.default_rng(0), q, kv, 4, 2000), spec_for(page_size=4, num_pages=2000))
    assert plan.mode is mode


def test_scale_and_soft_cap_come_from_the_spec():
    plan = build_plan(random_batch(np.random.default_rng(0), [1], [3], 16, 8), spec_for(num_pages=8, soft_cap=30.0))
    assert plan.sm_scale == pytest.approx(16**-0.5) and plan.soft_cap == 30.0 and plan.causal


# --- every PlanError ---------------------------------------------------------------------------

SPEC = spec_for(page_size=4, num_pages=32)


def batch(q, kv, pages, page_size=4):
    return StepBatch.from_pages(q, kv, [np.asarray(p) for p in pages], page_size)


@pytest.mark.parametrize(
    "step, match",
    [
        (batch([1, 0], [3, 2], [[0], [1]]), r"q_lens\[1\].*request 1"),
        (batch([1, -2], [3, 2], [[0], [1]]), r"q_lens\[1\]"),
        (batch([1, 4], [3, 2], [[0], [1]]), r"kv_lens\[1\].*smaller than q_len"),
        (batch([1, 1], [3, -1], [[0], [1]]), r"kv_lens\[1\]"),
        (batch([1, 1], [3, 9], [[0], [1, 2]]), r"page_indptr: request 1 lists 2 pages .*fewer than its KV length needs: 3 pages of 4 tokens for kv_len 9"),
        (StepBatch.from_csr([1, 1], [3, 3], [0, 2, 1], [5, 6, 7], 4), r"page_indptr\[2\]: decreases \(2 then 1\) \(request 1\)"),
        (StepBatch.from_csr([1, 1], [3, 3], [1, 2, 3], [5, 6, 7], 4), r"page_indptr must start at 0"),
        (StepBatch.from_csr([1, 1], [3, 3], [0, 1, 5], [5, 6, 7], 4), r"page_indptr.*within page_indices"),
        (batch([1, 1], [3, 5], [[0], [1, 33]]), r"request 1 lists page 33, outside the pool"),
        (batch([1, 1], [3, 5], [[0], [1, 32]]), r"request 1 lists page 32, the scratch page"),
        (batch([1, 1], [3, 3], [[0, 32], [1]]), r"request 0 lists page 32, the scratch page"),  # a spare entry too
        (batch([1, 1], [3, 3], [[7], [9, 7]]), r"page 7 is written .* requests \[0, 1\]"),  # B holds A's page as a spare
        (batch([1], [2**31 - 2], [[1]]), r"kv_lens\[0\].*int32"),
        (StepBatch.from_csr([1, 1], [3, 3], [0, 2**31 - 1, 1], [5, 6, 7], 4), r"page_indptr"),
        (StepBatch.from_csr([1, 1], [3, 3], [0, -1, 2], [5, 6, 7], 4), r"page_indptr"),
        (batch([1, 1], [3, 5], [[-1], [1, 2]]), r"request 0 lists page -1"),
        (batch([1, 1], [3, 3], [[7], [7]]), r"page 7 is written this step and also listed by requests \[0, 1\]"),
        (batch([1, 1], [6, 3], [[7, 9], [9]]), r"page 9 is written .* requests \[0, 1\]"),
        (batch([1, 1], [8, 3], [[7, 9], [7]]), r"page 7 is written .* requests \[0, 1\]"),
        (batch([5], [9], [[7, 8, 7]]), r"page 7 is written .* requests \[0\]"),
        (batch([1], [3], [[0]], page_size=8), r"page_size: the batch says 8, the cache has 4"),
        (StepBatch.from_csr([], [], [0], [], 4), r"empty"),
        (StepBatch.from_csr([1, 1], [3], [0, 1, 2], [0, 1], 4), r"shapes"),
    ],
)
def test_plan_errors_name_the_field_and_request(step, match):
    with pytest.raises(PlanError, match=match):
        build_plan(step, SPEC)


def test_valid_edge_steps_are_accepted():
    """kv_len 1, q_len == kv_len, page size 1, spare pages, the last page id, int64 input in range."""
    one = spec_for(page_size=1, num_pages=8)
    assert build_plan(StepBatch.from_pages([1], [1], [[7]], 1), one).slot_mapping.tolist() == [7]
    assert build_plan(StepBatch.from_pages([3], [3], [[0, 1, 2, 5]], 1), one).mode is Mode.PREFILL
    plan = build_plan(StepBatch.from_csr(np.array([1, 2], np.int64), np.array([5, 2], np.int64), np.array([0, 3, 5], np.uint32),
                                         np.array([31, 4, 6, 0, 1], np.int64), 4), SPEC)
    assert plan.kv_indices.tolist() == [31, 4, 0] and plan.slot_mapping.tolist() == [16, 0, 1]


def test_scratch_plans_touch_only_the_scratch_page():
    spec = spec_for(page_size=4, num_pages=10)
    for q_len in (1, 4, 9):
        plan = scratch_plan(spec, 3, q_len)
        assert set(plan.kv_indices.tolist()) == {10} and set((plan.slot_mapping // 4).tolist()) == {10}
        assert plan.mode is (Mode.DECODE if q_len == 1 else Mode.VERIFY)


def test_shared_read_only_prefix_pages_are_allowed():
    # Both requests read the full pages 3 and 4 (a shared prompt prefix) and write their own pages.
    plan = build_plan(batch([1, 2], [9, 10], [[3, 4, 5], [3, 4, 6]]), SPEC)
    assert plan.kv_indices.tolist() == [3, 4, 5, 3, 4, 6]


def test_ownership_check_can_be_left_to_a_trusted_allocator():
    shared_last_page = batch([1, 1], [3, 3], [[7], [7]])
    with pytest.raises(PlanError):
        build_plan(shared_last_page, SPEC)
    assert build_plan(shared_last_page, SPEC, check_ownership=False).slot_mapping.tolist() == [30, 30]


def test_block_table_too_narrow_is_a_page_error():
    with pytest.raises(PlanError, match=r"page_indptr: request 0 lists .* pages .*fewer than its KV length needs"):
        build_plan(StepBatch.from_block_table([1], [9], [[1, 2]], 4), SPEC)


def test_the_ownership_scan_is_the_same_on_each_of_its_paths(monkeypatch):
    """pages.scan_ownership over at most LISTED_SHORT listed pages (a set of Python ints) and over more (a table over
    every page id, or numpy's sort and hash table for a pool past DIRECT_PAGES and 4 pages per listed page): the same
    accept / reject and the same message on random lists whose written pages are now and then duplicated or listed
    by another request (LISTED_SHORT and DIRECT_PAGES patched: the set and the direct table on every case, the hashed
    table on the cases of the largest pool, counted)."""
    from mstar_attn.metadata import pages

    outcomes, hashed = {True: 0, False: 0}, []
    hits = pages.written_hits
    monkeypatch.setattr(pages, "written_hits", lambda *a: (hashed.append(1), hits(*a))[1])
    for _ in range(300):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        P, B = int(rng.choice([8, 64, 5000])), int(rng.integers(1, 9))
        spec = spec_for(page_size=4, num_pages=P)
        counts = rng.integers(1, 8, B)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        listed = rng.permutation(P)[: indptr[-1]].astype(np.int32) if indptr[-1] <= P else rng.integers(0, P, indptr[-1]).astype(np.int32)
        if rng.integers(3) == 0:  # another request lists a written page, or two requests write one
            listed[int(rng.integers(indptr[-1]))] = listed[indptr[int(rng.integers(1, B + 1))] - 1]
        written = listed[indptr[1:] - 1]
        got = []
        for limit, direct in ((1 << 30, 0), (0, 1 << 30), (0, 0)):  # (the Python set, the direct table, the hashed one)
            monkeypatch.setattr(pages, "LISTED_SHORT", limit)
            monkeypatch.setattr(pages, "DIRECT_PAGES", direct)
            try:
                pages.scan_ownership(spec, indptr, listed, written)
                got.append(None)
            except PlanError as e:
                got.append(str(e))
        assert got[0] == got[1] == got[2], f"seed {seed}: {got}"
        outcomes[got[0] is None] += 1
    assert min(outcomes.values()) > 30 and len(hashed) > 50, (outcomes, len(hashed))
