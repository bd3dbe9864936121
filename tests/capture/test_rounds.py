"""GraphBufferPool.commit_round on the CPU: each of the K steps' device views hold its plan (padding on
the scratch page), one copy moves the round, the steps live and go stale together, bad rounds are
refused before any state changes; and whole rounds through the reference backend, every step of every
request against the exact attention, rejected drafts' K/V never read."""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, PlanError, StaleStepError, StepBatch, build_plan
from mstar_attn.capture.graphs import RoundGraphs
from mstar_attn.capture.stage import copy_ranges
from mstar_attn.kernels import reference
from mstar_attn.metadata.draft import build_round
from tests.support.draft_rounds import DraftTrace, serve_rounds
from tests.helpers import pool_of, fresh_seed

GROUPS = (LayerGroup(), LayerGroup("window", window=7))


def _spec(ps=4, dtype=torch.bfloat16, pages=4000):
    return AttentionSpec(4, 2, 16, ps, pages, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=dtype)


def _pool(spec, k=8, **kw):
    return pool_of(spec, max_batch_size=16, max_num_tokens=128, max_num_pages=spec.num_pages, device="cpu",
                   buckets=(1, 4, 8), max_draft_steps=k, **kw)


def _round(seed, B=5, k=4, ps=4):
    rng = np.random.default_rng(seed)
    kv = rng.integers(1, 40, B)
    counts = -(-(kv + k - 1) // ps) + rng.integers(0, 2, B)
    pages = np.split(rng.permutation(4000)[: counts.sum()], np.cumsum(counts)[:-1])
    return build_round(StepBatch.from_pages(np.ones(B, np.int32), kv, pages, ps), _spec(ps), k)


@pytest.mark.parametrize("B", [3, 8, 11])  # padded to bucket 4, exactly bucket 8, past the largest bucket
def test_each_step_views_its_plan_and_padding_reads_the_scratch_page(B):
    seed = fresh_seed()
    draft = _round(seed, B)
    pool = _pool(draft.steps[0].spec)
    steps = pool.commit_round(draft)
    assert len(steps) == draft.k and len({(s.slot, s.generation) for s in steps}) == 1, seed
    rows = 4 if B == 3 else B
    for plan, step in zip(draft.steps, steps):
        assert step.plan is plan and step.padded_batch_size == rows and step.q_len == 1, seed
        assert np.array_equal(step.qo_indptr.numpy()[: B + 1], plan.qo_indptr), seed
        assert np.array_equal(step.slot_mapping.numpy()[:B], plan.slot_mapping), seed
        assert (step.slot_mapping.numpy()[B:] // 4 == plan.spec.scratch_page).all(), seed
        for dg, gp in zip(step.groups, plan.groups):
            n = gp.kv_indptr[-1]
            assert np.array_equal(dg.kv_indptr.numpy()[: B + 1], gp.kv_indptr), seed
            assert np.array_equal(dg.kv_indices.numpy()[:n], gp.kv_indices), seed
            assert (dg.kv_indices.numpy()[n:] == plan.spec.scratch_page).all(), seed
            assert np.array_equal(dg.kv_last_page_len.numpy()[:B], gp.kv_last_page_len), seed
            assert np.array_equal(dg.kv_lens.numpy()[:B], gp.kv_lens), seed
            assert (dg.kv_lens.numpy()[B:] == 1).all() and (dg.kv_last_page_len.numpy()[B:] == 1).all(), seed
            assert np.array_equal(dg.host_kv_lens.numpy()[:B], gp.kv_lens), seed


def test_a_round_is_one_copy_of_step_zero_plus_the_other_steps_arrays():
    """Bytes: a decode step's (one range from the draft region through group 0's indices, one more
    for the window group's), plus per further step slot_mapping (8 B) and last_page_len and kv_lens
    (4 B each per group) per request row, plus the pages the round lists past step 0's length."""
    seed = fresh_seed()
    draft = _round(seed, 8, 4)
    pool = _pool(draft.steps[0].spec, k=4)
    copies = []
    upload = pool.upload
    pool.upload = lambda dst, src: (copies.append(src.numel()), upload(dst, src))
    pool.commit_round(draft)
    assert len(copies) == 2, (seed, copies)  # one per layer group, as for one decode step
    got = pool.last_commit_bytes
    decode = build_plan(StepBatch.from_csr(np.ones(8, np.int32), draft.steps[0].kv_lens, draft.steps[0].kv_indptr,
                                           draft.steps[0].kv_indices, 4), draft.steps[0].spec)
    # (what a decode step's arrays staged on the host take: the pool derives a decode step's on the device instead)
    offsets = pool.layout.at(8, 8)
    staged = 4 * sum(b - a for a, b in copy_ranges(offsets, [(o.indices, o.indices + int(gp.kv_indptr[-1]))
                                                             for gp, o in zip(decode.groups, offsets.groups)], decode))
    ahead = sum(4 * (int(gp.kv_indptr[-1]) - int(gd.kv_indptr[-1])) for gp, gd in zip(draft.steps[0].groups, decode.groups))
    assert got == staged + ahead + 3 * 8 * (8 + 2 * 4 * 2), seed  # (ahead: the round's later pages)


def test_steps_go_stale_together_and_bad_rounds_change_nothing():
    seed = fresh_seed()
    draft = _round(seed)
    pool = _pool(draft.steps[0].spec, k=4)
    steps = pool.commit_round(draft)
    with pytest.raises(PlanError, match="commit_round"):
        pool.commit(draft.steps[1])
    with pytest.raises(PlanError, match="max_draft_steps"):
        pool.commit_round(_round(seed, k=5))
    with pytest.raises(PlanError, match="DraftRound"):
        pool.commit_round(draft.steps)
    assert all(s.live for s in steps) and pool.next_slot == 1 and pool.generations == [1, 0], seed
    pool.commit_round(draft)
    pool.commit_round(draft)  # the slot of `steps` again
    assert pool.generations == [2, 1] and not any(s.live for s in steps), seed
    for s in steps:
        with pytest.raises(StaleStepError):
            reference.run(s, torch.zeros(5, 4, 16, dtype=torch.bfloat16), PagedKVCache.allocate(s.plan.spec, "cpu"))


def test_pool_refuses_bad_max_draft_steps():
    for bad in (0, 17, 2.0):
        with pytest.raises(PlanError, match="max_draft_steps"):
            _pool(_spec(), k=bad)


def test_round_graphs_need_cuda():
    pool = _pool(_spec())
    graphs = RoundGraphs(pool, lambda steps, x: x["q"], {"q": torch.zeros(8, 4, 16)})
    with pytest.raises(PlanError, match="CUDA"):
        graphs.capture(4)


@pytest.mark.parametrize("ps, sinks", [(1, False), (4, False), (16, False), (4, True)])
def test_rounds_through_the_reference_backend_per_request(ps, sinks):
    """K = 1..8, a full and a window group (with attention sinks in one case): every step of every
    request against the exact attention, with the K/V of rejected drafts overwritten by large values
    after each round."""
    seed = fresh_seed()
    spec = _spec(ps)
    if sinks:
        spec = attrs.evolve(spec, groups=tuple(attrs.evolve(g, sinks=True) for g in GROUPS))
    pool = _pool(spec)
    caches = [PagedKVCache.allocate(spec, "cpu") for _ in range(2)]
    trace = DraftTrace(spec, seed, max_batch=10, max_context=60)
    ran = serve_rounds(trace, pool, reference, caches, [1, 2, 3, 4, 5, 6, 7, 8] * 2, seed)
    assert sum(ran.values()) == 16 and trace.poisoned > 0, seed


def test_decode_graphs_refuse_a_draft_step():
    """A draft step is not where a decode graph reads (steps 1.. have their own arrays): refused, not replayed."""
    from mstar_attn.capture.graphs import DecodeGraphs

    draft = _round(fresh_seed())
    pool = _pool(draft.steps[0].spec)
    steps = pool.commit_round(draft)
    graphs = DecodeGraphs(pool, lambda step, x: x["q"], {"q": torch.zeros(8, 4, 16)})
    assert not graphs.serves(steps[1])
    with pytest.raises(PlanError, match="RoundGraphs"):
        graphs(steps[1], q=torch.zeros(5, 4, 16))


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_layout_regions_never_overlap_with_draft_steps(groups):
    """Every region of Layout.at, draft blocks included, disjoint, int64 views on even offsets, for
    draft steps 1..6, rows 1..9 and token rows up to 3x."""
    from mstar_attn.capture.layout import Layout

    for D in range(1, 7):
        lay = Layout(16, 64, 40, groups, (0,) * groups, D)
        for rows in range(1, 10):
            for num_rows in (rows, 2 * rows + 1, 3 * rows):
                o = lay.at(rows, num_rows)
                spans = [(o.table_rows, rows * (1 + groups)), (o.updates, 2 * o.update_capacity), (o.qo, rows + 1),
                         (o.slots, 2 * num_rows)]
                for g in o.groups:
                    spans += [(g.kv_indptr, rows + 1), (g.last_page_len, rows), (g.kv_lens, rows), (g.indices, 41)]
                for at, per_group in o.draft_steps:
                    assert at % 2 == 0, (D, rows, num_rows)
                    spans += [(at, 2 * rows)] + [(a, rows) for pair in per_group for a in pair]
                assert len(o.draft_steps) == D - 1 and (D == 1 or o.draft_steps[-1][0] == o.draft)
                spans.sort()
                for (a, n), (b, _) in zip(spans, spans[1:]):
                    assert a + n <= b, (D, rows, num_rows, a, n, b)
                assert o.slots % 2 == 0 and spans[-1][0] + spans[-1][1] <= lay.size


def test_rounds_with_sinks_catch_a_backend_that_drops_them():
    """The same rounds through a reference whose sinks are -inf (weighing nothing: as if dropped) fail the
    per-request check: the trace's sinks are large enough to matter."""
    import types

    seed = fresh_seed()
    spec = attrs.evolve(_spec(4), groups=tuple(attrs.evolve(g, sinks=True) for g in GROUPS))
    drops = types.SimpleNamespace(write_kv=reference.write_kv, run=lambda step, q, cache, group=0, sinks=None: reference.run(
        step, q, cache, group=group, sinks=None if sinks is None else torch.full_like(sinks, -float("inf"))))
    caches = [PagedKVCache.allocate(spec, "cpu") for _ in range(2)]
    trace = DraftTrace(spec, seed, max_batch=10, max_context=60)
    with pytest.raises(AssertionError, match="norm-relative error"):
        serve_rounds(trace, _pool(spec), drops, caches, [1, 2, 3, 4], seed)
