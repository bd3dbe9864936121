"""metadata/record.py: a StepRows decode plan derives its arrays on first read, and they equal the arrays
the eager StepRows path holds for the same step (window groups included); plans compare by value."""

import attrs
import numpy as np
import pytest

from mstar_attn import GroupPages, Kind, LayerGroup, Mode, PlanError, StepBatch, build_plan
from mstar_attn.metadata.batch import StepRows
from mstar_attn.metadata.record import AttentionPlan
from tests.helpers import fresh_seed, spec_for

ARRAYS = ("qo_indptr", "kv_indptr", "kv_last_page_len", "positions", "q_lens", "kv_lens", "rows")
GROUP_ARRAYS = ("kv_indptr", "kv_last_page_len", "kv_lens", "kv_start")


def _steps(seed: int):
    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 4, 16]))
    window = int(rng.integers(1, 70))
    spec = spec_for(page_size=ps, groups=(LayerGroup(), LayerGroup("window", window=window), LayerGroup("noncausal")))
    B = int(rng.integers(1, 40))
    rows = rng.permutation(500)[:B].astype(np.int32)
    kv = rng.integers(1, 300, B).astype(np.int32)
    lazy = build_plan(StepRows.decode(rows, kv), spec)
    eager = build_plan(StepRows(rows, np.ones(B, np.int32), kv), spec)  # (the constructor: the general StepRows path)
    return spec, lazy, eager


def test_a_decode_plans_derived_arrays_equal_the_eager_paths():
    for _ in range(40):
        seed = fresh_seed()
        spec, lazy, eager = _steps(seed)
        assert lazy.mode is eager.mode is Mode.DECODE and lazy.backend == eager.backend, seed
        for g in range(len(spec.groups)):  # read before the arrays are derived, then after
            assert np.array_equal(lazy.kv_lens_of(g), eager.groups[g].kv_lens), (seed, g)
        for name in ARRAYS:
            a, b = getattr(lazy, name), getattr(eager, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (seed, name)
            assert not a.flags.writeable, (seed, name)
        for g, (a, b) in enumerate(zip(lazy.groups, eager.groups)):
            assert a.group == b.group and a.kv_indices is None and a.slot_mapping is None, (seed, g)
            for name in GROUP_ARRAYS:
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), (seed, g, name)
        assert lazy == eager and lazy.sealed, seed


def test_plans_that_differ_in_one_length_compare_unequal():
    seed = fresh_seed()
    spec, lazy, _ = _steps(seed)
    kv = lazy.kv_lens.copy()
    kv[-1] += 1
    other = build_plan(StepRows.decode(lazy.rows, kv), spec)
    assert lazy != other and not (lazy == other), seed
    assert np.array_equal(other.positions[:-1], lazy.positions[:-1]) and other.positions[-1] == lazy.positions[-1] + 1, seed
    assert lazy.__eq__(object()) is NotImplemented and isinstance(lazy, AttentionPlan)


def test_a_decode_plan_derives_only_what_is_read():
    """kv_lens_of (window groups included), positions and qo_indptr each leave the other arrays
    underived; reading groups derives them; every value equals the eager path's."""
    for _ in range(10):
        seed = fresh_seed()
        spec, lazy, eager = _steps(seed)
        assert not lazy.arrays_derived and eager.arrays_derived, seed
        for g in range(len(spec.groups)):
            assert np.array_equal(lazy.kv_lens_of(g), eager.groups[g].kv_lens), (seed, g)
        assert np.array_equal(lazy.positions, eager.positions) and np.array_equal(lazy.qo_indptr, eager.qo_indptr), seed
        assert not lazy.arrays_derived, seed
        assert len(lazy.groups) == len(spec.groups), seed
        assert lazy.arrays_derived, seed


def test_evolving_a_read_plan_derives_again_and_a_hand_made_plan_without_arrays_is_refused():
    seed = fresh_seed()
    spec, lazy, _ = _steps(seed)
    lazy.positions, lazy.groups  # (derived and cached)
    longer = attrs.evolve(lazy, kv_lens=lazy.kv_lens + 5, max_kv_len=lazy.max_kv_len + 5)
    assert np.array_equal(longer.positions, lazy.positions + 5), seed  # (the cache is not copied)
    assert np.array_equal(longer.groups[0].kv_lens, lazy.kv_lens + 5) and not longer.sealed, seed
    prefill = attrs.evolve(lazy, mode=Mode.PREFILL)
    with pytest.raises(PlanError, match="positions"):
        prefill.positions
    with pytest.raises(PlanError, match="groups"):
        attrs.evolve(lazy, rows=None).groups


def test_lazy_plans_compare_the_arrays_either_was_given_and_a_listed_one_without_its_indptr_is_refused():
    """Two lazy plans (a StepBatch decode step listing its pages) with the same stored fields are equal; one evolved
    with another slot_mapping or kv_indptr is not (the given array is compared, the other derived); a hand-made
    plan listing pages without their kv_indptr derives nothing: PlanError, not another exception."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, ps = int(rng.integers(2, 20)), 4
    kv = rng.integers(1, 100, B).astype(np.int32)
    need = -(-kv // ps)
    spec = spec_for(page_size=ps, num_pages=int(need.sum()) + 3)
    pages = np.split(rng.permutation(spec.num_pages)[: int(need.sum())], np.cumsum(need)[:-1])
    batch = StepBatch.from_pages(np.ones(B, np.int32), kv, pages, ps)
    a, b = build_plan(batch, spec), build_plan(batch, spec)
    assert a.lazy and b.lazy and a == b, seed
    assert attrs.evolve(a, slot_mapping=a.slot_mapping + 1) != b, seed
    assert attrs.evolve(a, slot_mapping=b.slot_mapping.copy()) == b, seed  # (the same values, given)
    indptr = a.kv_indptr.copy()
    indptr[1:] += 1  # (not the lists' running sums)
    assert attrs.evolve(a, kv_indptr=indptr) != b, seed
    bare = AttentionPlan(spec=spec, mode=Mode.DECODE, batch_size=B, num_tokens=B, max_q_len=1, max_kv_len=a.max_kv_len,
                         q_lens=a.q_lens, kv_lens=a.kv_lens, kv_indices=a.kv_indices)
    with pytest.raises(PlanError, match="slot_mapping"):
        bare.slot_mapping


def test_rows_decode_makes_the_plan_init_makes_field_for_field():
    """AttentionPlan.rows_decode (build_plan's per-step constructor) against __init__ on the same arguments: every
    attrs field, the instance's attribute names and a fresh derived-array cache of its own."""
    seed = fresh_seed()
    spec, lazy, _ = _steps(seed)
    init = AttentionPlan(spec=spec, mode=Mode.DECODE, batch_size=lazy.batch_size, num_tokens=lazy.batch_size, max_q_len=1,
                         max_kv_len=lazy.max_kv_len, q_lens=lazy.q_lens, kv_lens=lazy.kv_lens, kv_indices=None,
                         slot_mapping=None, backend=lazy.backend, rows=lazy.rows)
    object.__setattr__(init, "sealed", True)
    assert set(vars(init)) == set(vars(lazy)), f"seed {seed}"
    for field in attrs.fields(AttentionPlan):
        a, b = getattr(init, field.name), getattr(lazy, field.name)
        assert a is b or (field.name == "_cache" and a == b == {}), f"seed {seed}: field {field.name}: {a!r} vs {b!r}"
    other = AttentionPlan.rows_decode(spec, lazy.rows, lazy.q_lens, lazy.kv_lens, lazy.max_kv_len, lazy.backend)
    assert other._cache is not lazy._cache and not other.sealed and other == lazy, f"seed {seed}"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        lazy.max_kv_len = 1


@pytest.mark.parametrize("own", [False, True], ids=["shared-list", "own-list-group"])
def test_listed_decode_plans_are_what_init_makes_field_for_field(own):
    """build_plan's per-step constructors of a StepBatch decode step listing exactly its pages, against __init__ on
    the same arguments: every attrs field the same object, the instance's attribute names, a cache of its own. Every
    group on the shared list: AttentionPlan.lists_decode, lazy (its lengths and lists only); a group with a list of
    its own (own): AttentionPlan.listed_decode, every array given."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    ps, B = int(rng.choice([1, 4, 16])), int(rng.integers(1, 40))
    kv = rng.integers(1, 300, B).astype(np.int32)
    need = -(-kv // ps)
    window = LayerGroup("window", window=int(rng.integers(1, 70)), own_pages=own)
    spec = spec_for(page_size=ps, num_pages=int(need.sum()) + 3, groups=(LayerGroup(), window, LayerGroup("noncausal")))
    pages = np.split(rng.permutation(spec.num_pages)[: int(need.sum())], np.cumsum(need)[:-1])
    lists = {1: GroupPages.from_pages(np.zeros(B, np.int32), pages)} if own else None
    fast = build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, pages, ps, lists), spec)
    assert fast.lazy is not own, f"seed {seed}"
    given = dict(slot_mapping=fast.slot_mapping, qo_indptr=fast.qo_indptr, kv_last_page_len=fast.kv_last_page_len,
                 positions=fast.positions, groups=fast.groups) if own else {}
    init = AttentionPlan(spec=spec, mode=Mode.DECODE, batch_size=B, num_tokens=B, max_q_len=1, max_kv_len=fast.max_kv_len,
                         q_lens=fast.q_lens, kv_lens=fast.kv_lens, kv_indices=fast.kv_indices, backend=fast.backend,
                         kv_indptr=fast.kv_indptr, **given)
    object.__setattr__(init, "sealed", True)
    assert set(vars(init)) == set(vars(fast)), f"seed {seed}"
    for field in attrs.fields(AttentionPlan):
        a, b = getattr(init, field.name), getattr(fast, field.name)
        assert a is b or (field.name == "_cache" and a == b == {}), f"seed {seed}: field {field.name}: {a!r} vs {b!r}"
    assert init._cache is not fast._cache and init == fast, f"seed {seed}"


def test_a_group_that_is_neither_window_nor_own_list_reads_the_plans_own_kv_lens():
    """What FlashInfer's kept-schedule check relies on (kernels/flashinfer.py PoolState.plain): such a group's
    kv_lens are the plan's, for the lazy and the eager StepRows plan and for a StepBatch plan of the same step."""
    for _ in range(20):
        seed = fresh_seed()
        spec, lazy, eager = _steps(seed)
        ps, B = spec.page_size, lazy.batch_size
        pages = [(np.arange(-(-int(k) // ps)) + 7 * i) % spec.num_pages for i, k in enumerate(lazy.kv_lens)]
        batch = StepBatch.from_pages(np.ones(B, np.int32), lazy.kv_lens, pages, ps)  # (page ids do not matter here)
        for plan in (lazy, eager, build_plan(batch, spec, check_ownership=False)):
            for g, group in enumerate(spec.groups):
                if group.kind is not Kind.WINDOW and g not in spec.own_page_groups:
                    assert np.array_equal(plan.kv_lens_of(g), plan.kv_lens), (seed, g)
                    assert np.array_equal(plan.groups[g].kv_lens, plan.kv_lens), (seed, g)


def test_short_decode_arrays_equal_the_numpy_paths(monkeypatch):
    """decode_arrays over at most SHORT requests (Python ints, one array) gives what its numpy path gives: the same
    values and dtypes, read-only, for every page size and length (one past a page, exactly a page, one token)."""
    from mstar_attn.metadata import record

    for _ in range(200):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps, B = int(rng.choice([1, 2, 4, 16, 64])), int(rng.integers(1, record.SHORT + 1))
        kv = rng.choice([1, ps, ps + 1, 2 * ps, int(rng.integers(1, 5000))], B).astype(np.int32)
        spec, q = spec_for(page_size=ps), np.ones(B, np.int32)
        short = record.decode_arrays(spec, q, kv, int(kv.max()))
        monkeypatch.setattr(record, "SHORT", 0)
        long = record.decode_arrays(spec, q, kv, int(kv.max()))
        monkeypatch.undo()
        for name in ("qo_indptr", "positions", "need", "kv_indptr", "last_page_len"):
            a, b = getattr(short, name), getattr(long, name)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (seed, name)
            assert not a.flags.writeable, (seed, name)
        assert (short.num_tokens, short.q_max, short.max_kv, short.mode) == (long.num_tokens, long.q_max, long.max_kv, long.mode)


def test_lazy_cross_plans_compare_by_their_cross_rows():
    """Two lazy encoder-decoder decode plans (AttentionPlan.lazy_cross) of the same decoder step compare equal only
    when their cross groups (rows and encoder lengths) do."""
    import torch

    from mstar_attn import AttentionSpec, CrossRows, StepBatch, build_plan
    from tests.support.cross_pages import GROUPS

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, 4, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    B = int(rng.integers(2, 9))
    kv = rng.integers(1, 40, B).astype(np.int32)
    lists = np.split(rng.permutation(3000)[: int((-(-kv // 4)).sum())].astype(np.int32), np.cumsum(-(-kv // 4))[:-1])
    rows, enc = rng.permutation(64)[:B].astype(np.int32), rng.integers(1, 50, B).astype(np.int32)

    def plan(r, e):
        return build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, lists, 4, group_pages={1: CrossRows.of(r, e)}), spec)

    a, b = plan(rows, enc), plan(rows.copy(), enc.copy())
    assert a.lazy_cross is not None and a == b, f"seed {seed}"
    assert a != plan(rows[::-1].copy(), enc), f"seed {seed}: other rows"
    assert a != plan(rows, enc + 1), f"seed {seed}: other encoder lengths"
