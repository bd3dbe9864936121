"""The pool's page table and StepRows commits, on the CPU: ownership as pages are assigned, the
per-step checks, and the device arrays of a StepRows step equal to those of the same step given as
a StepBatch (page lists per group, slot_mapping), so every backend reads the same pages either way."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import LayerGroup, PagedKVCache, PlanError, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from mstar_attn.metadata.batch import StepRows
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN
from tests.helpers import assert_close_per_request, draw_lengths, fresh_seed, pool_of, spec_for

GROUPS = (LayerGroup(), LayerGroup("window", window=9))


def table_pool(spec, max_requests=40, width=64, **kw):
    return pool_of(spec, max_batch_size=32, max_num_tokens=600, max_num_pages=spec.num_pages, device="cpu",
                   buckets=kw.pop("buckets", (1, 2, 4, 8, 16)), max_requests=max_requests, max_pages_per_request=width, **kw)


def admit(pool, rng, kv_lens, shared_prefix=0):
    """Random distinct rows and free pages for each request (the first `shared_prefix` pages of
    every request shared read-only); returns (rows, the StepBatch of the same pages)."""
    table, ps = pool.table, pool.spec.page_size
    free = rng.permutation(np.flatnonzero(table.owner[:-1] == -1)).astype(np.int32)
    shared, free = free[:shared_prefix], free[shared_prefix:]
    rows = rng.choice(np.flatnonzero(table.counts[:-1] == 0), len(kv_lens), replace=False).astype(np.int32)
    lists = []
    for r, kv in zip(rows, kv_lens):
        own = -(-int(kv) // ps) - shared_prefix + int(rng.integers(0, 2))  # sometimes a spare page
        table.assign(int(r), shared, shared=True)
        table.assign(int(r), free[:own])
        lists.append(np.concatenate([shared, free[:own]]))
        free = free[own:]
    return rows, lists


def both_plans(spec, rows, lists, q_lens, kv_lens):
    csr = build_plan(StepBatch.from_pages(q_lens, kv_lens, lists, spec.page_size), spec)
    return build_plan(StepRows(rows, q_lens, kv_lens), spec), csr


def test_page_table_ownership_is_enforced_as_pages_are_assigned():
    spec = spec_for(page_size=4, num_pages=50)
    t = table_pool(spec, width=8).table
    t.assign(0, [5, 6])
    t.assign(1, [7, 8], shared=True)
    t.assign(2, [7], shared=True)
    for call, match in [(lambda: t.assign(3, [6]), "page 6 is held by row 0"),
                        (lambda: t.assign(3, [7]), "shared by 2 rows"),
                        (lambda: t.assign(3, [5], shared=True), "held by row 0"),
                        (lambda: t.assign(3, [9, 9]), "twice"),
                        (lambda: t.assign(1, [8], shared=True), "twice"),
                        (lambda: t.assign(3, [50]), "outside the pool"),
                        (lambda: t.assign(3, [-1]), "outside the pool"),
                        (lambda: t.assign(40, [9]), "not a table row"),
                        (lambda: t.assign(3, list(range(9, 18))), "more than max_pages_per_request 8"),
                        (lambda: t.append([3, 3], [9, 10]), "two pages in one call"),
                        (lambda: t.append([3, 4], [9, 9]), "given to two rows"),
                        (lambda: t.append([3], [5]), "not free"),
                        (lambda: t.append([3], [9, 10]), "one page per row"),
                        (lambda: t.append([3, 4], [60]), "page 60 is outside the pool"),  # (named before the counts)
                        (lambda: t.append([], [-1]), "outside the pool"),
                        (lambda: t.append([3] * 41, list(range(9, 50))), "row 3 is given two pages"),  # (more rows than the table)
                        (lambda: t.release(0, keep=3), "keep must be")]:
        before = (t.host.copy(), t.counts.copy(), t.owner.copy())
        with pytest.raises(PlanError, match=match):
            call()
        assert all(np.array_equal(a, b) for a, b in zip(before, (t.host, t.counts, t.owner))), match  # nothing changed
    t.append([3, 4], [9, 10])
    assert list(t.pages(3)) == [9] and list(t.pages(4)) == [10] and t.owner[9] == 3
    assert list(t.release(1)) == [7, 8] and t.owner[8] == -1 and t.owner[7] == -2  # row 2 still shares 7
    t.release(2)
    assert t.owner[7] == -1 and (t.host[2] == spec.scratch_page).all()
    assert list(t.release(0, keep=1)) == [6] and list(t.pages(0)) == [5] and t.owner[6] == -1


def test_the_device_table_follows_the_host_mirror_through_commits():
    """Admissions, growth and releases, many at a time (past a step's update region too)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
    pool = table_pool(spec)
    for step in range(30):
        live = np.flatnonzero(pool.table.counts[:-1])
        for r in rng.choice(live, min(len(live), int(rng.integers(2, 7))), replace=False):
            pool.table.release(int(r), keep=int(rng.integers(0, pool.table.counts[r] + 1)) * int(rng.integers(0, 2)))
        if (pool.table.counts[:-1] == 0).sum() < 5:
            for r in np.flatnonzero(pool.table.counts[:-1]):
                pool.table.release(int(r))
        kv = rng.integers(1, 120, int(rng.integers(1, 6)))
        rows, _ = admit(pool, rng, kv)
        B = int(rng.integers(1, len(rows) + 1))
        plan = build_plan(StepRows.decode(rows[:B], np.minimum(kv[:B], pool.table.counts[rows[:B]] * 4)), spec)
        pool.commit(plan)
        assert pool.table.pending == 0
        assert np.array_equal(pool.table.dev[:-1].numpy(), pool.table.flat), f"seed {seed}, step {step}"


def _device(step, plan):
    T = plan.num_tokens
    out = {"slots": step.slot_mapping[:T].numpy().copy()}
    for g, (dg, gp) in enumerate(zip(step.groups, plan.groups)):
        n, B = gp.kv_indptr[-1], plan.batch_size
        out[g] = (dg.kv_indptr.numpy()[: B + 1].copy(), dg.kv_indices[:n].numpy().copy(),
                  dg.kv_last_page_len.numpy()[:B].copy(), dg.kv_lens.numpy()[:B].copy())
    return out


@st.composite
def _steps(draw):
    ps, q, kv = draw_lengths(draw, (1, 4, 16), 12, 20, 60)
    uniform = draw(st.booleans())  # a bucketed verify step
    if uniform:
        q = [min(MAX_VERIFY_Q_LEN, q[0])] * len(q)
        kv = [max(k, q[0] + 1) for k in kv]
    return ps, q, kv, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=120, deadline=None)
@given(_steps())
def test_a_step_rows_commit_holds_the_same_arrays_as_the_same_step_by_pages(args):
    ps, q, kv, seed = args
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=ps, num_pages=1200, groups=GROUPS)
    pool = table_pool(spec, width=200)
    shared = int(rng.integers(0, 3)) if min(k - qq for k, qq in zip(kv, q)) >= 2 * ps else 0
    rows, lists = admit(pool, rng, kv, shared)
    plan, csr = both_plans(spec, rows, lists, q, kv)
    assert plan.mode is csr.mode and plan.kv_indices is None and plan.slot_mapping is None
    got, want = _device(pool.commit(plan), plan), _device(table_pool(spec, width=200).commit(csr), csr)
    assert np.array_equal(got["slots"], csr.slot_mapping), f"seed {seed}"
    for g in range(len(GROUPS)):
        for a, b in zip(got[g], want[g]):
            assert np.array_equal(a, b), (f"seed {seed}", g)


def test_the_reference_on_a_step_rows_step_equals_it_on_the_same_pages():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = spec_for(page_size=4, num_pages=800, groups=GROUPS, dtype=torch.float32)
    pool = table_pool(spec, width=100)
    q, kv = [1, 5, 1, 3], [9, 40, 1, 77]
    rows, lists = admit(pool, rng, kv)
    plan, csr = both_plans(spec, rows, lists, q, kv)
    cache = PagedKVCache.allocate(spec, "cpu")
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    ref_cache = PagedKVCache(cache.k.clone(), cache.v.clone())
    k, v = (torch.randn(plan.num_tokens, 2, 16, generator=gen) for _ in range(2))
    step = pool.commit(plan)
    reference.write_kv(step, k, v, cache)
    reference.write_kv(csr, k, v, ref_cache)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v), f"seed {seed}"
    x = torch.randn(plan.num_tokens, 4, 16, generator=gen)
    for g in range(2):
        assert_close_per_request(reference.run(step, x, cache, group=g), reference.run(csr, x, ref_cache, group=g),
                                 csr, torch.float32, f"seed {seed}")
    with pytest.raises(PlanError, match="StepRows plan names no pages"):
        reference.run(plan, x, cache)


def test_commit_refuses_bad_rows_and_changes_nothing():
    spec = spec_for(page_size=4, num_pages=100)
    pool = table_pool(spec)
    t = pool.table
    t.assign(0, [1, 2])
    t.assign(1, [3])
    t.assign(2, [4, 5], shared=True)
    t.assign(3, [4], shared=True)
    t.assign(3, [6])
    cases = [(StepRows.decode([0, 0], [5, 5]), "row 0 is listed twice"),
             (StepRows.decode([0, 40], [5, 5]), "row 40 is not a table row"),
             (StepRows.decode([0, 1], [5, 5]), "row 1 holds 1 pages, fewer than kv_len 5 needs"),
             (StepRows.decode([2], [6]), "writes page 5, which it shares read-only"),
             (StepRows([3], [2], [5]), "writes page 4, which it shares read-only"),  # a prefill chunk over a shared page
             (StepRows.decode([0], [65 * 4]), "more than max_pages_per_request")]
    t.append([4], [7])
    pending = t.pending  # must survive the failed commits
    t.check_step(build_plan(StepRows.decode([0, 3], [5, 5]), spec), slots=False)  # (rows the check remembers as distinct)
    for batch, match in cases:
        with pytest.raises(PlanError, match=match):
            pool.commit(build_plan(batch, spec))
    assert pool.generations == [0, 0] and t.pending == pending == 8
    pool.commit(build_plan(StepRows.decode([3], [8]), spec))  # reads shared page 4, writes its own page 6
    assert t.pending == 0 and t.dev[4 * 64] == 7
    no_table = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=8, max_num_pages=100), device="cpu")
    with pytest.raises(PlanError, match="needs a pool with a page table"):
        no_table.commit(build_plan(StepRows.decode([0], [5]), spec))
    with pytest.raises(PlanError, match="rows\\[1\\]: a page-table row is negative"):
        build_plan(StepRows.decode([0, -1], [5, 5]), spec)


def test_a_decode_step_rows_commit_copies_o_of_batch_bytes():
    """B = 256 decode over 2k-token contexts: the copy holds O(B) arrays, no page list."""
    spec = spec_for(page_size=16, num_pages=40000)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=2048, max_num_pages=40000,
                                            max_requests=300, max_pages_per_request=256), device="cpu")
    rng = np.random.default_rng(0)
    kv = rng.integers(1800, 2300, 256)
    rows, _ = admit(pool, rng, kv)
    pool.commit(build_plan(StepRows.decode(rows, kv), spec))  # admission: the pages go up once
    pool.table.append(rows[:16], np.flatnonzero(pool.table.owner[:-1] == -1)[:16])  # 16 requests start a page
    pool.commit(build_plan(StepRows.decode(rows, kv), spec))
    assert pool.last_commit_bytes <= 16 << 10, pool.last_commit_bytes
    assert pool.memory_report().components["page table"] == ((300 + 1) * 256 * 4 + 4, 0)
    print(f"B=256 decode StepRows commit: {pool.last_commit_bytes} bytes")


def test_the_decode_range_check_agrees_with_the_page_owners():
    """check_step's decode fast path (each row's kv_len inside the tokens it holds alone past its last
    shared page) against the exact check (the owner of the page the token lands on), on random
    tables changed by assign (shared and alone), append and release, and decode lengths random
    or on each row's last page (so that many steps are valid): the same steps pass, the same fail."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=600)
    table = table_pool(spec, max_requests=12, width=24).table
    free = list(rng.permutation(spec.num_pages).astype(np.int32))
    exact, written = [0], table.written

    def counted(*args):  # (the exact check: its calls tell how many checks the range path decided)
        exact[0] += 1
        return written(*args)

    table.written = counted
    checks = passes = 0
    for it in range(400):
        r = int(rng.integers(12))
        op = rng.choice(["own", "shared", "append", "release"])
        c = int(table.counts[r])
        if op == "own" and c < 20:
            table.assign(r, [free.pop() for _ in range(int(rng.integers(1, 4)))])
        elif op == "shared" and c < 20:
            shared = [free.pop() for _ in range(int(rng.integers(1, 3)))]
            table.assign(r, shared, shared=True)
            table.assign(int((r + 1) % 12), shared, shared=True) if table.counts[(r + 1) % 12] < 20 else None
        elif op == "append" and c < 24:
            table.append([r], [free.pop()])
        elif op == "release" and c:
            free += [int(p) for p in table.release(r, int(rng.integers(0, c + 1))) if table.owner[p] == -1]
        rows = rng.choice(12, int(rng.integers(1, 6)), replace=False).astype(np.int32)
        kv = rng.integers(1, 24 * 4 + 1, rows.shape[0]).astype(np.int32)
        if it % 2:  # (half the steps: each token on its row's last page, as a decode step writes; mostly valid)
            kv = np.maximum(table.counts[rows] * 4 - rng.integers(0, 4, rows.shape[0]), 1).astype(np.int32)
        _, bad = written(rows, kv - 1)
        plan = build_plan(StepRows.decode(rows, kv), spec)
        for _ in range(2):  # (the second time: the rows' ranges from the memo)
            try:
                table.check_step(plan, slots=False)
                passed = True
            except PlanError:
                passed = False
            assert passed == (not bad.any()), (seed, it, rows.tolist(), kv.tolist())
            checks, passes = checks + 1, passes + passed
    assert exact[0] < checks and passes > 0, (seed, exact[0], checks, passes)  # (the range path decided some)


WHY = ("two pages in one call", "given to two rows", "not free", "not a table row", "outside the pool", "already holds")


def test_append_of_a_few_rows_equals_the_vectorized_append(monkeypatch):
    """PageTable.append over at most APPEND_FEW rows runs on Python ints: on random calls, valid and not (rows out of
    range, repeated or full, pages out of the pool, repeated or held), it raises the same PlanError and leaves the
    same table as the vectorized path (APPEND_FEW 0) does."""
    from mstar_attn.capture import table as table_module

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=64)
    tables = [table_pool(spec, max_requests=12, width=6).table for _ in range(2)]  # [0]: short checks, [1]: long
    limits, kinds = (table_module.APPEND_FEW, 0), set()
    for t in tables:
        t.assign(0, [5, 6]), t.assign(1, [7], shared=True)
    for i in range(500):
        n = int(rng.integers(1, 6))
        rows = rng.integers(-1, 14, n) if rng.random() < 0.2 else rng.choice(12, n, replace=rng.random() < 0.2)
        free = np.flatnonzero(tables[0].owner[:-1] == -1)
        pages = rng.integers(-1, 66, n) if rng.random() < 0.2 else rng.choice(
            free if free.shape[0] >= n and rng.random() < 0.8 else 64, n, replace=rng.random() < 0.2)
        room = np.flatnonzero(tables[0].counts[:12] < 6)
        if i % 10 == 0 and room.shape[0] >= 2 and free.shape[0] >= 2:  # a repeat alone: of a row, or of a page
            rows, pages = rng.choice(room, 2, replace=False), rng.choice(free, 2, replace=False)
            if i % 20:
                rows[1] = rows[0]
            else:
                pages[1] = pages[0]
        outcome = []
        for t, short in zip(tables, limits):
            monkeypatch.setattr(table_module, "APPEND_FEW", short)
            try:
                t.append(rows.astype(np.int32) if rng.random() < 0.5 else rows.tolist(), pages.tolist())
                outcome.append(None)
            except PlanError as e:
                outcome.append(str(e))
        label = (f"seed {seed}", i, rows.tolist(), pages.tolist(), outcome)
        assert outcome[0] == outcome[1], label
        kinds.add(next((k for k in WHY if k in outcome[0]), outcome[0]) if outcome[0] else "ok")
        a, b = tables
        for name in ("host", "counts", "owner", "span", "low"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (label, name)
        assert a.changes == b.changes and np.array_equal(a.take_updates(), b.take_updates()), label
        if rng.random() < 0.3:  # room for more appends
            r = int(rng.integers(2, 12))
            for t in tables:
                t.release(r)
    assert kinds == {"ok", *WHY}, (seed, kinds)  # (successes and every kind of failure)


def test_pending_in_on_sets_equals_it_on_numpy(monkeypatch):
    """PageTable.pending_in over at most SHORT_SCAN touched and read rows compares Python sets: on random tables
    with updates pending (assigns, appends, releases) and random rows read, the same answer as np.isin (SHORT_SCAN
    0), and the answer itself: some pending entry lies in one of the rows."""
    from mstar_attn.capture import table as table_module

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=400)
    seen = set()
    for i in range(200):
        t = table_pool(spec, max_requests=40, width=8).table
        free = list(rng.permutation(400))
        t.take_updates()
        for r in rng.choice(40, int(rng.integers(0, 6)), replace=False).tolist():
            t.assign(r, [int(free.pop()) for _ in range(int(rng.integers(1, 4)))])
            if rng.random() < 0.3:
                t.release(r)
        pending = t.take_updates()
        t.restore_updates(pending)
        touched = set((pending // 8).tolist())
        rows = rng.choice(40, int(rng.integers(1, 12)), replace=False).astype(np.int32)
        want = bool(touched & set(rows.tolist()))
        got = []
        for short in (table_module.SHORT_SCAN, 0):
            monkeypatch.setattr(table_module, "SHORT_SCAN", short)
            got.append(t.pending_in(rows))
        assert got == [want, want], (f"seed {seed}", i, got, want)
        seen.add(want)
    assert seen == {True, False}, seed


def test_pending_counts_the_updates_take_updates_returns():
    """PageTable.pending, kept as the table changes: after random assigns, appends, releases, takes and restores,
    the number of positions take_updates returns (repeats counted), 0 right after a take."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=400)
    t = table_pool(spec, max_requests=40, width=8).table
    free, held, kinds = list(rng.permutation(400)), {}, set()
    for i in range(400):
        op = int(rng.integers(0, 5))
        r = int(rng.integers(0, 40))
        if op == 0 and r not in held:
            held[r] = int(rng.integers(1, 4))
            t.assign(r, [int(free.pop()) for _ in range(held[r])])
        elif op == 1 and held:
            rows = sorted(x for x in held if held[x] < 8)[:3]
            if rows:
                t.append(np.array(rows, np.int32), [int(free.pop()) for _ in rows])
                for x in rows:
                    held[x] += 1
        elif op == 2 and r in held:
            free += [int(p) for p in t.pages(r)]
            t.release(r)
            del held[r]
        elif op == 3:
            t.take_updates()
            assert t.pending == 0, (f"seed {seed}", i)
        else:
            taken = t.take_updates()
            t.restore_updates(taken)
        kinds.add(op)
        counted = t.pending  # (what assign, append and release queued, and restore put back)
        taken = t.take_updates()
        assert taken.shape[0] == counted and t.pending == 0, (f"seed {seed}", i, counted, taken.shape[0])
        t.restore_updates(taken)
        assert t.pending == taken.shape[0], (f"seed {seed}", i, t.pending, taken.shape[0])
    assert kinds == {0, 1, 2, 3, 4}, seed
