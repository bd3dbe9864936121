"""capture/steady.py on the CPU: the steady decode commit held to the general transaction it stands in for.

A decode step into a slot whose last general commit left a record is served steady when only its lengths
moved and pages were appended; then its arrays, slot staging and buffer, device table, generations, next slot
and bytes equal those of the same steps committed through the general path (a pool that never defers), and its
outputs equal per request. Any other change (an assign or release, rows, an explicit slot, defer=False, pending
work) takes the general path, and
every step stays equal to the same step by pages. A bad step still raises PlanError with nothing changed,
also in steady state. The ranges it checks (PageTable.decode_ranges, holds_decode, changes, a backend's promise
after appends): test_steady_ranges.py."""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import LayerGroup, PagedKVCache, PlanError, StepBatch, build_plan
from mstar_attn.capture.steady import intersect
from mstar_attn.metadata._arrays import SHORT, Ranges
from mstar_attn.metadata.batch import StepRows
from tests.capture.test_derive import GROUPS, _arrays
from tests.capture.test_graph_cache import _same_arrays
from tests.capture.test_table import admit, table_pool
from tests.helpers import fresh_seed, spec_for
from tests.support.staged import assert_same_outputs, assert_same_state, pool_state

PS = 4
SPECS = {"windows": GROUPS, "plain": (LayerGroup(),)}


def _spec(groups, num_pages=3000):
    return spec_for(page_size=PS, num_pages=num_pages, groups=groups)


def _by_pages(ref_pool, table, rows, kv):
    """The decode step over `rows` as `table` holds their pages now, given by pages and committed in `ref_pool`."""
    pages = [table.pages(int(r))[: -(-int(k) // PS)] for r, k in zip(rows, kv)]
    return ref_pool.commit(build_plan(StepBatch.from_pages(np.ones(len(rows), np.int32), kv, pages, PS), ref_pool.spec))


def _every_array_equal(step, other, label):
    got, want = _arrays(step), _arrays(other)
    assert np.array_equal(got[0], want[0]), label
    for g, (a, b) in enumerate(zip(got[1:], want[1:])):
        for j, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), (label, g, j)
    for name in ("slot_mapping", "table_rows"):
        assert torch.equal(getattr(step, name), getattr(other, name)), (label, name)


@pytest.mark.parametrize("appends", [False, True])
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("groups", SPECS.values(), ids=SPECS.keys())
def test_the_steady_commit_is_taken_and_equals_the_general_one(slots, groups, appends):
    """appends: each request starts with the pages its first step needs (and perhaps a spare) and is given one
    more (the same page in both pools' tables) when its next token starts a page: the engine's decode loop."""
    seed = fresh_seed()
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    spec, steps, B = _spec(groups), 30, int(rng.integers(2, 9))
    kv = rng.integers(10, 200, B).astype(np.int32)
    a, b = (table_pool(spec, width=160, num_slots=slots) for _ in range(2))  # a defers (steady), b never
    rows, _ = admit(a, rng, kv + (1 if appends else steps))  # (without appends: room for every step)
    for r in rows:
        b.table.assign(int(r), a.table.pages(int(r)))
    free = iter(rng.permutation(np.flatnonzero(a.table.owner[:-1] == -1)).astype(np.int32))
    steady_appends = 0  # steady commits of steps with an append
    cache = PagedKVCache.allocate(spec, "cpu")
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    caches = (cache, PagedKVCache(cache.k.clone(), cache.v.clone()))
    for i in range(steps):
        kv = kv + 1
        grow = rows[kv > a.table.counts[rows] * PS]  # (their new token starts a page past the ones they hold)
        if grow.shape[0]:
            pages = [next(free) for _ in grow]
            a.table.append(grow, pages), b.table.append(grow, pages)
        plan = build_plan(StepRows.decode(rows, kv), spec)
        s, gens, n0, bytes_a, bytes_b = a.next_slot, list(a.generations), a.steady.commits, a.bytes_to_device, b.bytes_to_device
        sa, sb = a.commit(plan, defer=True), b.commit(plan)
        label = (f"seed {seed}", slots, i)
        steady = a.steady.commits - n0
        assert steady in (0, 1) and (steady or i < 4), label
        steady_appends += steady and grow.shape[0] > 0
        assert sa.slot == sb.slot == s and sa.generation == sb.generation == gens[s] + 1, label
        assert a.generations == b.generations == [g + (k == s) for k, g in enumerate(gens)], label
        assert a.next_slot == b.next_slot == (s + 1) % slots, label
        sent = a.bytes_to_device - bytes_a
        assert sent == a.last_commit_bytes == b.bytes_to_device - bytes_b, (label, sent)
        if steady:
            assert sent == a.steady.records[s].offsets.draft * 4, label  # (the deferred copy of the head)
        assert sa.live and not any(sb.slots.work.pending), label
        sa.prepare()
        _every_array_equal(sa, sb, label)
        assert np.array_equal(a.host_np[s], b.host_np[s]) and torch.equal(a.dev[s], b.dev[s]), label
        if i % 6 == 5 or i == steps - 1:  # per-request outputs, each pool over its own cache
            assert_same_outputs((sa, sb), caches, gen, label)
    assert a.steady.commits >= steps - 4 and b.steady.commits == 0, (seed, a.steady.commits)
    assert steady_appends > 0 or not appends, (seed, "no steady commit took an append")
    for p in (a, b):
        assert torch.equal(p.table.dev[:-1], torch.from_numpy(p.table.flat)), seed


@pytest.mark.parametrize("slots", [1, 2])
def test_every_change_but_an_append_takes_the_general_path_and_every_step_stays_right(slots):
    """A random walk of decode steps over table changes (append, release and assign), row changes (a
    permutation, a subset), non-deferred commits and commits into an explicit slot, each step used now,
    after the next commit, or never: every used step equals the same step by pages; a commit is steady
    exactly when its slot's record still holds (an append it absorbs), never the first one into a slot after
    another change."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = _spec(GROUPS)
    pool, ref = table_pool(spec, width=160, num_slots=slots), table_pool(spec, width=160)  # (ref: 2 slots, see "late")
    table, B, n = pool.table, int(rng.choice([3, 5, 6])), 80
    kv = rng.integers(10, 150, B).astype(np.int32)
    rows, _ = admit(pool, rng, kv + n + 1)  # (room for every step and the last one)
    free = iter(rng.permutation(np.flatnonzero(table.owner[:-1] == -1)).astype(np.int32))
    sel, dirty, waiting = np.arange(B), set(), None
    steady_seen = after_change = 0
    ops = ["none", "append", "replace", "rows", "eager", "slot"]
    for i in range(n):
        op = rng.choice(ops, p=[0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
        if op == "append":
            table.append([int(rng.choice(rows))], [next(free)])
        elif op == "replace":  # a row's pages from the one its next token lands on replaced by others
            j = int(rng.integers(B))
            c, need = int(table.counts[rows[j]]), -(-int(kv[j] + 1) // PS)
            table.release(int(rows[j]), keep=need - 1)
            table.assign(int(rows[j]), [next(free) for _ in range(c - need + 1)])
        elif op == "rows":  # another order of the same rows (lengths with them), or a subset; none a record holds
            held = {rows[sel].tobytes()} | {rec.rows for rec in pool.steady.records if rec is not None}
            while rows[sel].tobytes() in held:
                sel = rng.permutation(sel) if rng.random() < 0.5 else rng.permutation(B)[: int(rng.integers(1, B + 1))]
        if op in ("replace", "rows"):  # (an append: a steady commit absorbs it)
            dirty = set(range(slots))
        kv[sel] += 1
        r, k = rows[sel], kv[sel]
        plan = build_plan(StepRows.decode(r, k), spec)
        ref_step = _by_pages(ref, table, r, k)
        n0, recs, pending = pool.steady.commits, list(pool.steady.records), any(pool.device_work.pending)
        rec = recs[pool.next_slot]
        if op == "eager":
            step = pool.commit(plan)
        elif op == "slot":
            step = pool.commit(plan, slot=int(rng.integers(slots)), defer=True)
        else:
            step = pool.commit(plan, defer=True)
        label = (f"seed {seed}", slots, i, op)
        steady = pool.steady.commits - n0
        expect = op in ("none", "append", "replace", "rows") and not pending and rec is not None and \
            rec.table_reshapes == table.reshapes and rec.rows == r.tobytes()
        assert steady == expect, (label, steady, pending)
        old = recs[step.slot]  # a general commit into a slot drops its record (a new one may replace it)
        assert steady or old is None or pool.steady.records[step.slot] is not old, label
        if step.slot in dirty:  # the first commit into this slot since a change
            assert not steady, label
            dirty.discard(step.slot)
            after_change += 1
        steady_seen += steady
        if waiting is not None and waiting[0].live:  # used after the next commit (launched by it)
            assert waiting[1].live, label
            waiting[0].prepare()
            _same_arrays(waiting[0], waiting[1], B, (label, "late"))
        use = rng.choice(["now", "late", "never"], p=[0.6, 0.2, 0.2])
        if use == "now":
            step.prepare()
            _same_arrays(step, ref_step, B, label)
        waiting = (step, ref_step) if use == "late" else None
    kv[sel] += 1
    pool.commit(build_plan(StepRows.decode(rows[sel], kv[sel]), spec), defer=True).prepare()
    assert torch.equal(table.dev[:-1], torch.from_numpy(table.flat)), (seed, slots)
    assert steady_seen > 0 and after_change > 0, (seed, steady_seen, after_change)


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("pending", [False, True])
@pytest.mark.parametrize("groups", SPECS.values(), ids=SPECS.keys())
def test_a_bad_step_raises_before_anything_changes_also_in_steady_state(groups, pending, append):
    """pending: the last good step's deferred work is left unlaunched (the failed commits must not launch it).
    append: pages appended to a row of the step and to a row outside it just before the bad steps (the records
    then stand for an older table: the failed commits leave them, and the pending updates, as they were)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, B, shared = _spec(groups), 4, 2
    pool, ref = table_pool(spec, width=160), table_pool(spec, width=160)
    kv = rng.integers(3 * PS + 2, 120, B).astype(np.int32)
    rows, _ = admit(pool, rng, kv + 20, shared_prefix=shared)
    table = pool.table

    def good(kv, spec=spec, prepare=True):  # a good step: committed, its arrays those of the step by pages
        n0, ref_step = pool.steady.commits, _by_pages(ref, table, rows, kv)
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
        if prepare:
            step.prepare()
            _same_arrays(step, ref_step, B, (f"seed {seed}", kv.tolist()))
        return pool.steady.commits - n0

    for i in range(6):
        kv = kv + 1
        good(kv, prepare=not pending or i < 5)
    assert pool.steady.commits >= 2 and any(pool.device_work.pending) == pending, seed
    if append:
        outside = int(np.flatnonzero(table.counts[:-1] == 0)[0])
        table.append([int(rows[0]), outside], np.flatnonzero(table.owner[:-1] == -1)[:2])
    nxt, j = kv + 1, int(rng.integers(B))
    past, in_shared = nxt.copy(), nxt.copy()
    past[j] = table.counts[rows[j]] * PS + int(rng.integers(1, 2 * PS))  # past the pages its row holds
    in_shared[j] = int(rng.integers(1, shared * PS + 1))  # its token on a page the row shares read-only
    other = _spec(groups, num_pages=2999)
    bad = {"fewer than kv_len": build_plan(StepRows.decode(rows, past), spec),
           "shares read-only": build_plan(StepRows.decode(rows, in_shared), spec),
           "not made by build_plan": attrs.evolve(build_plan(StepRows.decode(rows, nxt), spec), kv_lens=nxt.copy()),
           "another AttentionSpec": build_plan(StepRows.decode(rows, nxt), other)}
    for name, plan in bad.items():
        before = pool_state(pool)
        with pytest.raises(PlanError, match=name):
            pool.commit(plan, defer=True)
        assert_same_state(before, pool_state(pool), (f"seed {seed}", name))
    assert good(nxt) == (not pending), seed  # (nothing changed: steady again, unless work was pending)
    equal = _spec(groups)  # an equal spec, another object: the general path serves it, the steady one never
    assert equal == spec and equal is not spec
    assert good(nxt + 1, equal) == 0, seed
    assert sum(good(nxt + d) for d in range(2, 6)) >= 2, seed


@pytest.mark.parametrize("B", [5, SHORT + 8])  # (Ranges.holds: a Python loop up to SHORT requests, numpy past)
def test_intersect_holds_what_every_range_holds(B):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for it in range(20):
        ranges = tuple(Ranges(rng.integers(-20, 30, B).astype(np.int32),
                              (rng.integers(0, 25, B) * (rng.random(B) > 0.15)).astype(np.uint32))
                       for _ in range(int(rng.integers(1, 4))))
        got = intersect(ranges)
        lows = [r.low.astype(np.int64) for r in ranges]
        highs = [lo + r.span for lo, r in zip(lows, ranges)]
        edges = [v for lo, hi in zip(lows, highs) for v in (lo - 1, lo, hi - 1, hi)]
        for vals in [*edges, got.low, got.low.astype(np.int64) + got.span - 1, *rng.integers(-25, 60, (6, B))]:
            vals = np.asarray(vals, np.int64)
            member = np.all([(lo <= vals) & (vals < hi) for lo, hi in zip(lows, highs)], axis=0)
            assert got.holds(vals.astype(np.int32)) == member.all(), (f"seed {seed}", it)
            for i in range(B):
                one = Ranges(got.low[i : i + 1], got.span[i : i + 1])
                assert one.holds(vals[i : i + 1].astype(np.int32)) == member[i], (f"seed {seed}", it, i, int(vals[i]))
        empty = np.max(lows, axis=0) >= np.min(highs, axis=0)
        assert (got.span[empty] == 0).all() and (got.span[~empty] > 0).all(), (f"seed {seed}", it)


def test_a_token_tree_step_over_the_same_rows_is_never_served_steady():
    """A verify step of one-node draft trees over a slot's rows (build_tree_plan of a StepRows.decode: a lazy,
    sealed plan of q_len 1) takes the general path, which schedules trees, and leaves no record; decode steps
    after it are steady again once a plain decode commit has recorded its slot."""
    from mstar_attn.metadata.plan import build_tree_plan
    from mstar_attn.metadata.tree import DraftTree

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = _spec((LayerGroup(),))
    pool = table_pool(spec, width=160, num_slots=1)
    kv = rng.integers(10, 100, 3).astype(np.int32)
    rows, _ = admit(pool, rng, kv + 20)
    for _ in range(3):
        kv = kv + 1
        pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True).prepare()
    assert pool.steady.commits >= 1, f"seed {seed}"
    kv = kv + 1
    tree = build_tree_plan(StepRows.decode(rows, kv), spec, DraftTree.from_parents([[-1]] * 3))
    n = pool.steady.commits
    step = pool.commit(tree, defer=True)
    assert pool.steady.commits == n and step.plan.tree is not None, f"seed {seed}"
    assert pool.steady.records[step.slot] is None, f"seed {seed}: a tree step left a record"
    step.prepare()
    for i in range(2):
        kv = kv + 1
        pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True).prepare()
        assert pool.steady.commits == n + i, (f"seed {seed}", i)  # (the first records, the second is steady)


@pytest.mark.parametrize("slots", [1, 2])
def test_appends_outside_the_step_and_past_its_update_region_stay_right(slots):
    """Decode steps over fixed rows while pages are appended to the step's rows (as their tokens start pages) and to
    rows outside it (0 to 40 a step: past the step's update region now and then, then the general path sends them):
    every step's arrays equal the same step by pages, the device table its host mirror; steady commits carry updates
    of rows outside the step, and a step with more pending updates than its region holds is never steady."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, B, n = _spec(GROUPS), 4, 40
    pool, ref = table_pool(spec, width=160, num_slots=slots), table_pool(spec, width=160)
    table = pool.table
    kv = rng.integers(10, 150, B).astype(np.int32)
    rows, _ = admit(pool, rng, kv + 1)
    others = [r for r in range(table.max_requests) if r not in set(rows.tolist())]
    free = iter(rng.permutation(np.flatnonzero(table.owner[:-1] == -1)).astype(np.int32))
    outside_steady = overflow = 0
    for i in range(n):
        kv = kv + 1
        grow = rows[kv > table.counts[rows] * PS]
        if grow.shape[0]:
            table.append(grow, [next(free) for _ in grow])
        room = [r for r in others if table.counts[r] < table.width]
        extra = rng.choice(room, min(len(room), int(rng.choice([0, 2, 40], p=[0.4, 0.4, 0.2]))), replace=False)
        if extra.shape[0]:
            table.append(extra.astype(np.int32), [next(free) for _ in extra])
        rec, pending, n0 = pool.steady.records[pool.next_slot], table.pending, pool.steady.commits
        capacity = None if rec is None else rec.offsets.update_capacity
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
        steady = pool.steady.commits - n0
        label = (f"seed {seed}", slots, i, pending, capacity)
        if capacity is not None and pending > capacity:
            assert not steady, label
            overflow += 1
        outside_steady += steady and extra.shape[0] > 0
        step.prepare()
        _same_arrays(step, _by_pages(ref, table, rows, kv), B, label)
        assert torch.equal(table.dev[:-1], torch.from_numpy(table.flat)), label
    assert outside_steady > 0 and overflow > 0, (seed, outside_steady, overflow)


def test_the_records_are_in_the_memory_report_and_bounded_by_the_slots():
    """The steady records hold pageable host memory only (two [B] range arrays per slot, a promise's too), listed
    in the pool's memory report with no device or pinned bytes."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, B = _spec(GROUPS), 5
    pool = table_pool(spec, width=160, num_slots=2)
    kv = rng.integers(10, 150, B).astype(np.int32)
    rows, _ = admit(pool, rng, kv + 10)
    for _ in range(6):
        kv = kv + 1
        pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True).prepare()
    assert pool.memory_report().components["steady records (pageable host)"] == (0, 0), seed
    assert pool.steady.commits > 0 and 0 < pool.steady.host_bytes() <= 2 * 2 * B * 4, (seed, pool.steady.host_bytes())



@pytest.mark.parametrize("B", [4, 48])  # (Ranges on Python lists up to SHORT_CHECK requests, numpy arrays past)
def test_a_step_at_the_rows_last_token_is_steady_and_one_past_it_is_refused(B):
    """Every row holding P pages, no shared prefix: each row's decode range is 1..P * PS, so a steady commit answers at
    once (Ranges.holds_from_one) for a step whose longest length is P * PS, the last token the rows hold: steady, its
    arrays those of the step by pages. A step with one request at P * PS + 1 (the rest at most that) is refused as the
    general commit refuses it (PlanError, nothing changed), and the next good step is steady again."""
    from tests.helpers import pool_of

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, P = _spec((LayerGroup(),)), 6
    pools = [pool_of(spec, max_batch_size=64, max_num_tokens=600, max_num_pages=spec.num_pages, device="cpu",
                     buckets=(64,), max_requests=80, max_pages_per_request=16) for _ in range(2)]
    pool, ref = pools
    table, top = pool.table, P * PS
    rows = rng.choice(80, B, replace=False).astype(np.int32)
    free = rng.permutation(spec.num_pages).astype(np.int32)
    for i, r in enumerate(rows.tolist()):
        table.assign(r, free[i * P : (i + 1) * P])
    kv = rng.integers(top - 8, top - 3, B).astype(np.int32)

    def step(kv):  # a commit of the step; returns whether it was a steady one, its arrays checked against the pages
        n0, want = pool.steady.commits, _by_pages(ref, table, rows, kv)
        got = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
        got.prepare()
        _same_arrays(got, want, B, (f"seed {seed}", kv.tolist()))
        return pool.steady.commits - n0

    for _ in range(3):
        kv = kv + 1
        step(kv)
    at_end = np.minimum(kv + 1, top).astype(np.int32)
    at_end[int(rng.integers(B))] = top  # (the longest exactly the rows' last token)
    assert step(at_end) == 1, seed
    past = at_end.copy()
    past[int(rng.integers(B))] = top + 1
    before = pool_state(pool)
    with pytest.raises(PlanError, match="fewer than kv_len"):
        pool.commit(build_plan(StepRows.decode(rows, past), spec), defer=True)
    assert_same_state(before, pool_state(pool), f"seed {seed}")
    assert step(at_end) == 1, seed
