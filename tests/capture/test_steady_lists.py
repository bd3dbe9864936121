"""capture/steady.py for StepBatch decode steps that list exactly their pages (AttentionPlan.lists_decode), on the CPU:
the steady commit of such a step held to the general derived commit it stands in for (the same slot, generation,
staging, device arrays, bytes and outputs per request), taken step after step while only the lengths and the lists
move, and left for the general path (which checks everything) by any other change; a bad step raises PlanError
with nothing changed, also in steady state."""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import LayerGroup, PagedKVCache, PlanError, StepBatch, build_plan
from mstar_attn.metadata.batch import StepRows
from tests.capture.test_derive import GROUPS
from tests.capture.test_table import table_pool
from tests.helpers import fresh_seed, pool_of, spec_for
from tests.support.staged import (assert_same_outputs, assert_same_arrays, assert_same_state, pool_state, staged_arrays, steady_step,
                                  step_arrays)

PS = 4
SPECS = {"windows": GROUPS, "plain": (LayerGroup(),)}


def _pool(spec, slots: int, table: bool):
    """A CPU pool of buckets up to 16 requests, with a page table (it takes StepRows steps too) or without."""
    if table:
        return table_pool(spec, width=160, num_slots=slots)
    return pool_of(spec, max_batch_size=32, max_num_tokens=600, max_num_pages=spec.num_pages, device="cpu",
                   buckets=(1, 2, 4, 8, 16), num_slots=slots)


class _Lists:
    """B requests, each with its own pages (room for `room` more tokens), listing exactly what kv_lens need."""

    def __init__(self, rng, spec, B: int, room: int):
        self.kv = rng.integers(10, 200, B).astype(np.int32)
        need = -(-(self.kv + room) // PS)
        self.pages = np.split(rng.permutation(spec.num_pages)[: int(need.sum())].astype(np.int32), np.cumsum(need)[:-1])

    def plan(self, spec, kv=None):
        kv = self.kv if kv is None else kv
        lists = [p[: -(-int(k) // PS)] for p, k in zip(self.pages, kv)]
        return build_plan(StepBatch.from_pages(np.ones(len(kv), np.int32), kv, lists, PS), spec)


@pytest.mark.parametrize("table", [False, True], ids=["no-table", "table"])
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("groups", SPECS.values(), ids=SPECS.keys())
def test_the_steady_commit_of_listed_steps_is_taken_and_equals_the_general_one(groups, slots, table):
    seed = fresh_seed()
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    spec, steps, B = spec_for(page_size=PS, num_pages=3000, groups=groups), 30, int(rng.integers(2, 12))
    a, b = _pool(spec, slots, table), _pool(spec, slots, table)  # a defers (steady), b never
    eng = _Lists(rng, spec, B, steps)
    cache = PagedKVCache.allocate(spec, "cpu")
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    caches = (cache, PagedKVCache(cache.k.clone(), cache.v.clone()))
    for i in range(steps):
        eng.kv = eng.kv + 1
        plan = eng.plan(spec)
        s, gens, n0, bytes_a, bytes_b = a.next_slot, list(a.generations), a.steady.commits, a.bytes_to_device, b.bytes_to_device
        sa, sb = a.commit(plan, defer=True), b.commit(plan)
        label = (f"seed {seed}", slots, table, i)
        steady = a.steady.commits - n0
        assert steady in (0, 1) and (steady or i < 2 * slots), label
        assert sa.slot == sb.slot == s and sa.generation == sb.generation == gens[s] + 1, label
        assert a.generations == b.generations and a.next_slot == b.next_slot == (s + 1) % slots, label
        assert a.bytes_to_device - bytes_a == a.last_commit_bytes == b.bytes_to_device - bytes_b, label
        assert sa.live and not any(sb.slots.work.pending), label
        sa.prepare()
        assert np.array_equal(a.host_np[s], b.host_np[s]) and torch.equal(a.dev[s], b.dev[s]), label
        assert_same_arrays(step_arrays(sa), staged_arrays(a, plan, sa.padded_batch_size), label)
        if i % 6 == 5:  # per-request outputs, each pool over its own cache
            assert_same_outputs((sa, sb), caches, gen, label)
    assert a.steady.commits >= steps - 2 * slots and b.steady.commits == 0, (seed, a.steady.commits)


@pytest.mark.parametrize("slots", [1, 2])
def test_every_other_change_takes_the_general_path_and_every_step_stays_right(slots):
    """A request leaving the batch, a StepRows step into the slot, an equal spec of another object, defer=False, a
    step left pending: each commit after it is general (no steady commit), and then steady again; every step's
    arrays are the host staging's."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=PS, num_pages=3000, groups=GROUPS)
    pool = _pool(spec, slots, True)
    eng = _Lists(rng, spec, 6, 80)
    rows = np.flatnonzero(pool.table.counts[:-1] == 0)[:2].astype(np.int32)
    for r in rows:  # (two rows of the table, for a StepRows step into the slots between)
        pool.table.assign(int(r), np.flatnonzero(pool.table.owner[:-1] == -1)[-3:])

    def step(label, spec=spec, defer=True, prepare=True, kv=None):
        eng.kv = eng.kv + 1 if kv is None else kv
        return steady_step(pool, eng.plan(spec), (f"seed {seed}", label), defer, prepare)

    def settle():
        assert sum(step("settle") for _ in range(2 * slots + 1)) >= 1, seed

    settle()
    eng.pages, kv = eng.pages[:-1], eng.kv[:-1] + 1  # a request leaves
    assert step("a request left", kv=kv) == 0, seed
    settle()
    pool.commit(build_plan(StepRows.decode(rows, np.array([5, 6], np.int32)), spec), defer=True)
    assert sum(step("after a StepRows step") for _ in range(slots)) == 0, seed
    settle()
    equal = spec_for(page_size=PS, num_pages=3000, groups=GROUPS)
    assert step("an equal spec", spec=equal) == 0, seed
    settle()
    assert step("defer=False", defer=False) == 0, seed
    settle()
    step("left pending", prepare=False)
    assert step("after a pending step") == 0, seed  # (the commit launches the pending work first)
    settle()


@pytest.mark.parametrize("slots", [1, 2])
def test_a_bad_listed_step_raises_before_anything_changes_also_in_steady_state(slots):
    """In steady state: a plan not made by build_plan, one for another AttentionSpec, lists past the slot's index
    region; each raises PlanError with the pool as it was, and the next good step is steady again."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=PS, num_pages=3000, groups=GROUPS)
    pool = _pool(spec, slots, True)
    eng = _Lists(rng, spec, 5, 40)
    for _ in range(2 * slots + 2):
        eng.kv = eng.kv + 1
        pool.commit(eng.plan(spec), defer=True).prepare()
    assert pool.steady.commits >= 2, seed
    nxt = eng.kv + 1
    # every request reading one long shared prefix (read-only) and its own last page: more page entries in all
    # than the slot's index region holds
    free = np.flatnonzero(~np.isin(np.arange(3000), np.concatenate(eng.pages))).astype(np.int32)
    n = pool.layout.index_capacity // 5 + 2
    shared = [np.append(free[:n], free[n + i]) for i in range(5)]
    big = build_plan(StepBatch.from_pages(np.ones(5, np.int32), np.full(5, (n + 1) * PS, np.int32), shared, PS), spec)
    bad = {"not made by build_plan": attrs.evolve(eng.plan(spec, nxt), kv_lens=nxt.copy()),
           "another AttentionSpec": eng.plan(spec_for(page_size=PS, num_pages=3001, groups=GROUPS), nxt),
           "more than the pool holds": big}
    for name, plan in bad.items():
        before = pool_state(pool)
        with pytest.raises(PlanError, match=name):
            pool.commit(plan, defer=True)
        assert_same_state(before, pool_state(pool), (f"seed {seed}", name))
    n0 = pool.steady.commits
    eng.kv = nxt
    plan = eng.plan(spec)
    step = pool.commit(plan, defer=True)
    step.prepare()
    assert pool.steady.commits == n0 + 1, seed
    assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, step.padded_batch_size), f"seed {seed}")
