"""Layer groups with their own page lists (metadata/groups.py): plans, slots, trimming and the errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import AttentionSpec, GroupPages, LayerGroup, PlanError, StepBatch, build_plan
from mstar_attn.metadata.batch import StepRows
from mstar_attn.metadata.plan import scratch_plan
from tests.helpers import draw_lengths, fresh_seed


def hybrid_spec(ps, window, num_pages=4096, own=True):
    """A full group, a window group on its own list (or, own=False, on the shared one), and a
    second window group on the shared list."""
    groups = (LayerGroup(), LayerGroup("window", window=window, own_pages=own), LayerGroup("window", window=window + 5))
    return AttentionSpec(4, 2, 16, ps, num_pages, groups=groups, layer_groups=(0, 1, 2), backend="reference")


@st.composite
def hybrid_steps(draw):
    """A random step, each request's own list starting anywhere from page 0 to the first page its
    window sees, with 0-2 spare pages after; shared pages from ids 0..2047, own ones from 2048.."""
    ps, q, kv = draw_lengths(draw, (1, 4, 16), 8, 40, 200)  # (at most 8 x 240 pages of 1 token: within the 2048 ids)
    window = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    need = [-(-k // ps) for k in kv]
    start = [max(k - n - (window - 1), 0) // ps for n, k in zip(q, kv)]
    first = [int(rng.integers(0, s + 1)) for s in start]
    counts = [n - f + int(rng.integers(0, 3)) for n, f in zip(need, first)]
    own = np.split(2048 + rng.permutation(2048)[: sum(counts)], np.cumsum(counts)[:-1])
    base = np.split(rng.permutation(2048)[: sum(need)], np.cumsum(need)[:-1])
    return ps, window, q, kv, first, [o.tolist() for o in own], [b.tolist() for b in base]


@settings(max_examples=150, deadline=None)
@given(hybrid_steps())
def test_an_own_list_plans_as_the_shared_list_would_over_the_same_pages(case):
    """The window group's plan from its own list equals its plan from a shared list holding those
    pages at the same logical positions (ranges, lengths, window start), and its slots are those pages'."""
    ps, window, q, kv, first, own, base = case
    pages = GroupPages.from_pages(first, own)
    plan = build_plan(StepBatch.from_pages(q, kv, base, ps, group_pages={1: pages}), hybrid_spec(ps, window))
    # the same pages in one shared list: the shared pages below each own list's first page, then the own ones
    need = [-(-k // ps) for k in kv]
    merged = [b[:f] + o[: n - f] for b, f, o, n in zip(base, first, own, need)]
    same = build_plan(StepBatch.from_pages(q, kv, merged, ps), hybrid_spec(ps, window, own=False))
    gp, want = plan.groups[1], same.groups[1]
    for field in ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "kv_start"):
        assert np.array_equal(getattr(gp, field), getattr(want, field)), (field, case)
    assert np.array_equal(gp.slot_mapping, same.slot_mapping) and np.array_equal(plan.slots_of(1), same.slot_mapping)
    # the groups on the shared list are untouched by the own list
    alone = build_plan(StepBatch.from_pages(q, kv, base, ps), hybrid_spec(ps, window, own=False))
    assert np.array_equal(plan.slot_mapping, alone.slot_mapping) and plan.groups[0].slot_mapping is None
    for g in (0, 2):
        assert np.array_equal(plan.groups[g].kv_indices, alone.groups[g].kv_indices)
        assert np.array_equal(plan.slots_of(g), alone.slot_mapping)
    # every own slot is on the request's own pages, at its token's offset
    pos = plan.positions
    req = np.repeat(np.arange(len(q)), q)
    own_page = [own[i][p // ps - first[i]] for i, p in zip(req, pos)]
    assert np.array_equal(gp.slot_mapping, np.array(own_page, np.int64) * ps + pos % ps)


def _batch(q, kv, ps=4, own=None, first=None, base=None):
    base = base or [list(range(10 * i, 10 * i + -(-k // ps))) for i, k in enumerate(kv)]
    own = own or [list(range(100 + 10 * i, 100 + 10 * i + -(-k // ps))) for i, k in enumerate(kv)]
    first = first or [0] * len(kv)
    return StepBatch.from_pages(q, kv, base, ps, group_pages={1: GroupPages.from_pages(first, own)})


def test_a_decode_step_writes_each_group_through_its_own_pages():
    spec = hybrid_spec(4, 6)
    # request 0: 9 tokens, window 6 from position 3: pages 0.. ; request 1: 30 tokens, sees 24..29: page 6 on
    plan = build_plan(_batch([1, 1], [9, 30], own=[[100, 101, 102], [207, 208]], first=[0, 6]), spec)
    assert plan.slot_mapping.tolist() == [2 * 4 + 0, 17 * 4 + 1]
    assert plan.groups[1].slot_mapping.tolist() == [102 * 4 + 0, 208 * 4 + 1]
    assert plan.groups[1].kv_indices.tolist() == [100, 101, 102, 207, 208]
    assert plan.groups[1].kv_start.tolist() == [0, 24] and plan.groups[1].kv_lens.tolist() == [9, 6]


@pytest.mark.parametrize("q, kv, first, own, match", [
    ([1, 1], [9, 30], [0, 7], None, r"group_pages\[1\]\.first_page\[1\]: .*reads from page 6.*\(request 1\)"),
    ([1, 1], [9, 30], [-1, 0], None, r"group_pages\[1\]\.first_page\[0\]"),
    ([3, 1], [30, 9], [5, 0], [[105, 106], [200, 201, 202]],
     r"group_pages\[1\]\.page_indices\[0\]: lists 2 pages from logical page 5, fewer than kv_len 30 needs"),
    ([1, 1], [9, 30], [0, 6], [[100, 101, 4096], [207, 208]], r"group_pages\[1\]\.page_indices: request 0 lists page 4096, the scratch"),
    ([1, 1], [9, 30], [0, 6], [[100, 101, 5000], [207, 208]], r"request 0 lists page 5000, outside the pool"),
    ([1, 1], [9, 30], [0, 6], [[100, 101, 208], [207, 208]], r"group_pages\[1\]\.page_indices: page 208 is written"),
    ([4, 4], [9, 30], [0, 5], [[100, 101, 102], [205, 206, 102]], r"group_pages\[1\]\.page_indices: page 102 is written"),
])
def test_bad_own_lists_name_the_field_and_the_request(q, kv, first, own, match):
    with pytest.raises(PlanError, match=match):
        build_plan(_batch(q, kv, own=own, first=first), hybrid_spec(4, 6))


def test_read_only_pages_may_be_listed_by_several_requests():
    """A window-list prefix page two requests read and neither writes (prefix caching) is fine."""
    spec = hybrid_spec(4, 40)
    plan = build_plan(_batch([1, 1], [9, 10], own=[[100, 101, 102], [100, 111, 112]]), spec)
    assert plan.groups[1].kv_indices.tolist() == [100, 101, 102, 100, 111, 112]


def test_the_own_lists_must_match_the_spec():
    spec = hybrid_spec(4, 6)
    base = StepBatch.from_pages([1], [5], [[0, 1]], 4)
    with pytest.raises(PlanError, match=r"group_pages: layer group 1 keeps its own page list"):
        build_plan(base, spec)
    lists = GroupPages.from_pages([0], [[7, 8]])
    with pytest.raises(PlanError, match=r"group_pages\[0\]: layer group 0 reads the shared page list"):
        build_plan(StepBatch.from_pages([1], [5], [[0, 1]], 4, group_pages={0: lists, 1: lists}), spec)
    with pytest.raises(PlanError, match=r"group_pages\[3\]: the spec has 3 layer groups"):
        build_plan(StepBatch.from_pages([1], [5], [[0, 1]], 4, group_pages={1: lists, 3: lists}), spec)
    with pytest.raises(PlanError, match=r"group_pages\[1\]: first_page \(2,\) and page_indptr \(2,\) must be \[B\] and \[B\+1\]"):
        build_plan(StepBatch.from_pages([1], [5], [[0, 1]], 4, group_pages={1: GroupPages.from_pages([0, 0], [[7, 8]])}), spec)
    with pytest.raises(PlanError, match="group_pages: keys are layer-group indices"):
        StepBatch.from_pages([1], [5], [[0, 1]], 4, group_pages={"1": lists})
    with pytest.raises(PlanError, match=r"group_pages\[1\]: expected a GroupPages"):
        StepBatch.from_pages([1], [5], [[0, 1]], 4, group_pages={1: [[7, 8]]})
    with pytest.raises(PlanError, match="LayerGroup.own_pages: expected True or False"):
        LayerGroup("window", window=4, own_pages="yes")
    with pytest.raises(PlanError, match="StepRows: layer group 1 keeps its own page list"):
        build_plan(StepRows([0], [1], [5]), spec)


def test_the_scratch_plan_gives_own_groups_the_scratch_page():
    spec = hybrid_spec(4, 6)
    plan = scratch_plan(spec, 3, q_len=4)
    assert set(plan.groups[1].kv_indices.tolist()) == {spec.scratch_page}
    assert set((plan.groups[1].slot_mapping // 4).tolist()) == {spec.scratch_page}


def test_malformed_group_pages_name_the_list_and_the_request():
    with pytest.raises(PlanError, match=r"GroupPages pages\[1\]\[1\] = 1099511627776 is outside int32 \(request 1\)"):
        GroupPages.from_pages([0, 0], [[1], [1, 2**40]])
    with pytest.raises(PlanError, match=r"GroupPages.first_page: integers required"):
        GroupPages([0.5], [0, 1], [3])
    bad = GroupPages([0, 0, 0], [0, 2, 1, 3], [100, 101, 102])
    with pytest.raises(PlanError, match=r"group_pages\[1\]\.page_indptr\[2\]: decreases \(2 then 1\) \(request 1\)"):
        build_plan(StepBatch.from_pages([1] * 3, [2] * 3, [[0], [1], [2]], 4, group_pages={1: bad}), hybrid_spec(4, 6))


def cross_spec(ps=4, backend="reference"):
    return AttentionSpec(4, 2, 16, ps, 4096, groups=(LayerGroup(), LayerGroup("cross")), layer_groups=(0, 1), backend=backend)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 4, 16]))
def test_a_cross_plan_reads_every_encoder_key_and_stores_new_encoders_on_their_pages(seed, ps):
    """Each request reads the first ceil(encoder / page_size) pages of its cross list (spare pages
    after are left out); the requests storing their encoder this step get one slot per encoder
    token, in request order, on those pages."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 8))
    enc, q = rng.integers(1, 200, B), rng.integers(1, 4, B)
    write = rng.random(B) < 0.5
    need = -(-enc // ps)
    counts = need + rng.integers(0, 2, B)
    pages = np.split(rng.permutation(4096)[: int(counts.sum())], np.cumsum(counts)[:-1])
    base = np.split(np.arange(int((-(-q // ps)).sum())), np.cumsum(-(-q // ps))[:-1])
    plan = build_plan(StepBatch.from_pages(q, q, base, ps, group_pages={1: GroupPages.cross(pages, enc, write)}),
                      cross_spec(ps))
    gp = plan.groups[1]
    assert gp.group.cross and not gp.group.causal and gp.kv_start is None
    assert np.array_equal(gp.kv_lens, enc) and np.array_equal(np.diff(gp.kv_indptr), need)
    assert np.array_equal((need - 1) * ps + gp.kv_last_page_len, enc)
    for i in range(B):
        assert np.array_equal(gp.kv_indices[gp.kv_indptr[i] : gp.kv_indptr[i + 1]], pages[i][: need[i]])
    want = [int(pages[i][t // ps]) * ps + t % ps for i in range(B) if write[i] for t in range(int(enc[i]))]
    assert gp.slot_mapping.tolist() == want, seed
    assert np.array_equal(plan.slots_of(0), plan.slot_mapping)


def _cross_batch(enc, pages, write=None, q=(1, 1), **kw):
    base = [[10 * i] for i in range(len(q))]
    return StepBatch.from_pages(list(q), list(q), base, 4, group_pages={1: GroupPages.cross(pages, enc, write)}, **kw)


@pytest.mark.parametrize("enc, pages, write, match", [
    ([0, 3], [[], [5]], None, r"group_pages\[1\]\.kv_lens\[0\]: a step with cross-attention layers needs encoder input"),
    ([9, 3], [[1, 2], [5]], None, r"group_pages\[1\]\.page_indices\[0\]: fewer pages than the encoder length needs"),
    ([4, 3], [[1], [1]], [True, False], r"group_pages\[1\]\.page_indices: page 1 is written this step and also listed"),
    ([4, 3], [[4096], [5]], None, r"request 0 lists page 4096, the scratch page"),
])
def test_bad_cross_lists_name_the_field_and_the_request(enc, pages, write, match):
    with pytest.raises(PlanError, match=match):
        build_plan(_cross_batch(enc, pages, write), cross_spec())


def test_cross_groups_need_their_lengths_and_keep_to_paged_kernels():
    spec = cross_spec()
    with pytest.raises(PlanError, match=r"group_pages\[1\]\.kv_lens: layer group 1 is cross attention"):
        build_plan(StepBatch.from_pages([1], [1], [[0]], 4, group_pages={1: GroupPages.from_pages([0], [[5]])}), spec)
    lists = GroupPages([0], [0, 1], [5], [3], [2])
    with pytest.raises(PlanError, match=r"group_pages\[1\]\.new_lens\[0\]: a step stores a request's whole encoder"):
        build_plan(StepBatch.from_pages([1], [1], [[0]], 4, group_pages={1: lists}), spec)
    own = (LayerGroup(), LayerGroup("window", window=4, own_pages=True))
    with pytest.raises(PlanError, match=r"group_pages\[1\]: kv_lens / new_lens are for cross-attention groups"):
        build_plan(StepBatch.from_pages([1], [1], [[0]], 4, group_pages={1: GroupPages([0], [0, 1], [5], [3])}),
                   AttentionSpec(4, 2, 16, 4, 64, groups=own, backend="reference"))
    ragged = AttentionSpec(4, 2, 64, 4, 64, groups=(LayerGroup(), LayerGroup("cross")), backend="flashinfer_ragged")
    with pytest.raises(PlanError, match="attends over the step's new K/V only; the spec's cross-attention layers"):
        build_plan(StepBatch.from_pages([3], [3], [[0]], 4, group_pages={1: GroupPages.cross([[5]], [2])}), ragged)
    with pytest.raises(PlanError, match="GroupPages.cross: write must be"):
        GroupPages.cross([[5]], [2], ["yes"])
    with pytest.raises(PlanError, match="LayerGroup.own_pages"):
        LayerGroup("cross", own_pages=None)
    assert LayerGroup("cross").own_pages and not LayerGroup("cross").causal


@pytest.mark.parametrize("head_dim", [64, 128])
def test_auto_never_picks_a_prefix_free_backend_for_cross_layers(head_dim):
    """A prefill step (all KV new) may go to ragged / varlen kernels by the dispatch table; with a
    cross group they would attend over the decoder tokens instead of the encoder's, so build_plan
    asks the table without prefix_free and the table serves only all-causal specs: a paged backend
    serves every such step. (On a machine without the GPU packages the table has no entries and
    this checks the default; the explicit ragged refusal is tested above.)"""
    from mstar_attn import BACKENDS

    groups = (LayerGroup(), LayerGroup("cross"))
    spec = AttentionSpec(32, 8, head_dim, 16, 4096, groups=groups, layer_groups=(0, 1), backend="auto")
    for q in ([512] * 8, [2000] * 2, [40, 300, 7]):
        need = [-(-n // 16) for n in q]
        pages = np.split(np.arange(sum(need)), np.cumsum(need)[:-1])
        plan = build_plan(StepBatch.from_pages(q, q, pages, 16, group_pages={1: GroupPages.cross([[9]] * len(q), [5] * len(q))}),
                          spec)  # (one encoder page all requests read: parallel samples of one input)
        assert plan.mode.value == "prefill" and not BACKENDS[plan.backend].prefix_free, plan.backend



@pytest.mark.parametrize("ps", [1, 4, 16])
def test_window_decode_ranges_hold_exactly_the_lengths_whose_group_lengths_stay_in_range(ps):
    """groups.window_decode_ranges (a steady decode commit's window-group terms): every plan kv_len it holds has
    its window-group length (as a lazy decode plan derives it) inside the given range (sound); it holds every
    kv_len over the step's first read page whose group length is in range, and for a range holding every length
    past the window (window .. window + ps - 1), every kv_len whose group length is in range (all it may hold).
    Brute force over kv_lens 1 .. window + 6 pages, plus lengths near int32's end; each kind of range is drawn."""
    from mstar_attn.metadata._arrays import Ranges
    from mstar_attn.metadata.groups import first_read_page, window_decode_ranges

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    W = int(rng.integers(1, 50))
    group = LayerGroup("window", window=W)
    spec = AttentionSpec(4, 2, 64, ps, 4000, groups=(group,), backend="reference")
    top, B = W + 6 * ps, 12
    kv = rng.integers(1, top, B).astype(np.int32)
    glen = build_plan(StepRows.decode(np.arange(B, dtype=np.int32), kv), spec).kv_lens_of(0)
    low = np.maximum(glen - rng.integers(0, 3 * ps, B), 1).astype(np.int64)
    span = rng.integers(1, 4 * ps, B).astype(np.int64)
    low[:3] = (1, min(W, int(glen[1])), 1)  # (a range over every length, one past the window only, one capped:)
    span[:3] = (2**31 - 1, 2**31 - low[1], W + ps)
    span[3] = 0  # (an empty range)
    given = Ranges(low.astype(np.int32), span.astype(np.uint32))
    got = window_decode_ranges(group, kv, given, ps)
    wide = (low <= W) & (low + span >= W + ps)
    assert wide[:3].all() and not wide[3], f"seed {seed}"
    for x in [*range(1, top + 3 * ps), 2**31 - 3 * ps, 2**31 - 2 * ps]:
        if x < top + 3 * ps:  # (as a lazy decode plan derives them; past int32's page offsets, by first_read_page)
            lens = build_plan(StepRows.decode(np.arange(B, dtype=np.int32), np.full(B, x, np.int32)), spec).kv_lens_of(0)
        else:
            one = np.full(B, x, np.int64)
            lens = one - first_read_page(group, np.ones(B, np.int64), one, ps) * ps
        for i in range(B):
            held = int(got.low[i]) <= x < int(got.low[i]) + int(got.span[i])
            inside = int(low[i]) <= int(lens[i]) < int(low[i]) + int(span[i])
            same_page = max(x - W, 0) // ps == max(int(kv[i]) - W, 0) // ps
            assert held == (inside and (same_page or wide[i])), (f"seed {seed}", W, ps, i, x, int(kv[i]), held, inside)


def test_cross_rows_plans_on_python_ints_equal_the_numpy_paths(monkeypatch):
    """cross_rows_plan over at most SHORT requests (Python ints) plans what its numpy path plans, and refuses what
    it refuses with the same PlanError: lengths below 1 or past int32, partial stores, negative rows, sums past int32."""
    from mstar_attn import CrossRows
    from mstar_attn.metadata import groups

    def outcome(batch, spec, short):
        monkeypatch.setattr(groups, "SHORT", short)
        try:
            return build_plan(batch, spec).groups[1]
        except PlanError as e:
            return str(e)

    big = 2**31 - 1
    for _ in range(300):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps, B = int(rng.choice([1, 4, 16])), int(rng.integers(1, 65))
        enc = rng.integers(1, 3000, B)
        rows, write = rng.integers(0, 64, B), rng.random(B) < 0.3
        new = np.where(write, enc, 0)
        fault = rng.integers(0, 8)  # 0-2: valid; else one field broken at a random request
        i = int(rng.integers(0, B))
        if fault == 3:
            enc[i] = 0
        elif fault == 4:
            enc[i] = big - int(rng.integers(0, ps))
        elif fault == 5:
            new[i] = max(1, enc[i] - 1) if new[i] == 0 else new[i] - 1
        elif fault == 6:
            rows[i] = -1 - int(rng.integers(0, 5))
        elif fault == 7 and B > 1:  # every request stores: more encoder tokens than int32 offsets hold
            enc[:], new[:] = big // B + 1000, big // B + 1000
        cross = CrossRows(rows, enc, new)
        batch = StepBatch.from_pages([1] * B, [1] * B, [[j] for j in range(B)], ps, group_pages={1: cross})
        spec = cross_spec(ps)
        a, b = outcome(batch, spec, groups.SHORT), outcome(batch, spec, 0)
        assert a == b, (seed, fault, a, b)
        if fault < 3:
            assert not isinstance(a, str) and not a.kv_indptr.flags.writeable and a.kv_indptr.dtype == np.int32, seed
