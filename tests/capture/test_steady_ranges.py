"""capture/steady.py on the CPU: the length ranges a steady commit checks. PageTable.decode_ranges (and
PageTable.holds_decode, the same check without the Ranges) holds exactly what PageTable.check_step accepts of a
decode step, PageTable.changes counts every change, and a backend's promise still bounds steady commits once
appends changed the table."""

import numpy as np
import pytest

from mstar_attn import LayerGroup, PlanError, build_plan
from mstar_attn.metadata._arrays import SHORT, Ranges
from mstar_attn.metadata.batch import StepRows
from tests.capture.test_steady import PS, _spec
from tests.capture.test_table import admit, table_pool
from tests.helpers import fresh_seed

LONG = SHORT + 8  # a batch past the short (Python-int) paths


def test_decode_ranges_hold_what_check_step_accepts_and_changes_count_every_change():
    """On a table changed by assign (alone and shared), append and release: per row, decode_ranges holds
    exactly the decode lengths check_step accepts (its range path and its exact one), lengths at the
    range's edges and random, for rows whose shared pages came first (an engine's prefix); never more for
    a row given shared pages after its own ones (mixed); and a call that changes a row counts in `changes`."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, W = _spec((LayerGroup(),), num_pages=600), 24
    table = table_pool(spec, max_requests=12, width=W).table
    free = [int(p) for p in rng.permutation(spec.num_pages)]
    accepted = refused = 0
    seen = {(B, h): 0 for B in (5, LONG) for h in (True, False)}  # (batch checks that held / did not)
    mixed = np.zeros(12, bool)  # (rows given shared pages after pages of their own, until released whole)
    for it in range(150):
        r = int(rng.integers(12))
        c = int(table.counts[r])
        before = (table.host.copy(), table.counts.copy(), table.low.copy(), table.span.copy(), table.changes)
        op = rng.choice(["own", "shared", "append", "release"])
        if op == "own" and c < W - 3:
            table.assign(r, [free.pop() for _ in range(int(rng.integers(1, 4)))])
        elif op == "shared" and c < W - 2:
            mixed[r] |= (table.owner[table.pages(r)] >= 0).any()
            table.assign(r, [free.pop() for _ in range(int(rng.integers(1, 3)))], shared=True)
        elif op == "append" and c < W:
            table.append([r], [free.pop()])
        elif op == "release" and c:
            keep = int(rng.integers(0, c + 1))
            free += [int(p) for p in table.release(r, keep) if table.owner[p] == -1]
            mixed[r] &= keep > 0
        else:
            continue
        moved = any(not np.array_equal(x, y) for x, y in zip(before[:4], (table.host, table.counts, table.low, table.span)))
        assert table.changes > before[4] or not moved, (f"seed {seed}", it, op)
        for row in range(12):
            ranges = table.decode_ranges(np.array([row], np.int32))
            lo, span = int(ranges.low[0]), int(ranges.span[0])
            for kv in {lo - 1, lo, lo + span - 1, lo + span, lo + span + 1, int(rng.integers(1, W * PS + 2))}:
                if kv < 1:
                    continue
                plan = build_plan(StepRows.decode(np.array([row], np.int32), np.array([kv], np.int32)), spec)
                holds = ranges.holds(np.array([kv], np.int32))
                assert table.holds_decode(np.array([row], np.int32), np.array([kv], np.int32)) == holds, (seed, it, row, kv)
                for slots in (False, True):
                    try:
                        table.check_step(plan, slots=slots)
                        ok = True
                    except PlanError:
                        ok = False
                    assert ok == holds if not mixed[row] else ok or not holds, (
                        f"seed {seed}", it, row, kv, lo, span, slots, bool(mixed[row]))
                if not mixed[row]:
                    accepted, refused = accepted + holds, refused + (not holds)
        held = np.flatnonzero(table.span[:12] > 0)
        for B in (5, LONG) if held.shape[0] else ():  # holds_decode over a batch (Ranges.holds' Python and numpy paths)
            rows = rng.choice(held, B).astype(np.int32)
            low, span = table.low[rows].astype(np.int64), table.span[rows].astype(np.int64)
            kv = low + rng.integers(0, span)  # inside each range; one request at or past an edge half the time
            if rng.integers(2):
                j = int(rng.integers(B))
                kv[j] = low[j] - 1 if rng.integers(2) else low[j] + span[j]
            kv = np.maximum(kv, 1).astype(np.int32)
            batch_holds = table.decode_ranges(rows).holds(kv)
            assert table.holds_decode(rows, kv) == batch_holds, (f"seed {seed}", it, B)
            seen[B, batch_holds] += 1
    assert accepted > 100 and refused > 100 and min(seen.values()) > 5, (seed, accepted, refused, seen)


@pytest.mark.parametrize("B", [4, LONG])
def test_a_backend_promise_still_bounds_steady_commits_after_appends(monkeypatch, B):
    """A backend state's promise (SteadyTerms.ranges) is checked on every steady commit, also once appends changed the
    table (a short batch's path and a long one's): a length past the promise, inside the table's ranges, takes the
    general path. The reference backend promises nothing, so each record gets a promise of the recorded lengths and
    the next two (injected for the test); a page is appended to one of the step's rows before every commit."""
    from mstar_attn.capture import pool as pool_module
    from mstar_attn.capture.steady import SteadyTerms
    from tests.helpers import pool_of

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = _spec((LayerGroup(),), num_pages=6000)
    pool = table_pool(spec, max_requests=80, width=160, num_slots=1, buckets=(4, 64)) if B <= SHORT else \
        pool_of(spec, max_batch_size=128, max_num_tokens=600, max_num_pages=spec.num_pages, buckets=(128,), max_requests=LONG + 8,
                max_pages_per_request=160, num_slots=1, device="cpu")
    kv = rng.integers(10, 60, B).astype(np.int32)
    rows, _ = admit(pool, rng, kv + 40)  # (room: the table's ranges never end the walk)
    free = iter(rng.permutation(np.flatnonzero(pool.table.owner[:-1] == -1)).astype(np.int32))
    recorded = {}
    monkeypatch.setattr(pool_module, "SteadyTerms", lambda scheduled: SteadyTerms(
        scheduled=scheduled, ranges=(Ranges(recorded["kv"].copy(), np.full(B, 3, np.uint32)),)))
    pattern = []
    for i in range(12):
        kv = kv + 1
        r = int(rng.choice(rows))
        if pool.table.counts[r] < 160:
            pool.table.append([r], [next(free)])
        recorded["kv"] = kv
        n0 = pool.steady.commits
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
        step.prepare()
        pattern.append(pool.steady.commits - n0)
    assert pattern == [0, 1, 1] * 4, (f"seed {seed}", pattern)
