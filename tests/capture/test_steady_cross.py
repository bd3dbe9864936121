"""capture/steady.py for encoder-decoder decode steps (a self group on the shared list beside a cross group of
cross-table rows storing nothing: AttentionPlan.lazy_cross), on the CPU: the steady commit held to the general
derived commit it stands in for (the same slot, generation, staging, device arrays, bytes and outputs per request)
step after step, and left for the general path by a cross-table update pending in its rows or another batch."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, CrossRows, PagedKVCache, StepBatch, build_plan
from mstar_attn.capture.table import FREE
from tests.helpers import fresh_seed, pool_of
from tests.support.cross_pages import GROUPS
from tests.support.staged import assert_same_arrays, assert_same_outputs, staged_arrays, steady_step, step_arrays

PS = 4


def _pool(spec, slots: int):
    return pool_of(spec, max_batch_size=32, max_num_tokens=600, max_num_pages=spec.num_pages, device="cpu",
                   buckets=(1, 2, 4, 8, 16), num_slots=slots, max_requests=64, max_pages_per_request=200,
                   max_encoder_tokens=4000)


class _Requests:
    """B requests: each a cross-table row of its encoder's pages (in every pool given, the same) and decoder pages of
    its own with room for `room` more tokens; plan() lists exactly what the lengths need."""

    def __init__(self, rng, spec, pools, B: int, room: int):
        self.rows = rng.permutation(64)[:B].astype(np.int32)
        self.enc = rng.integers(1, 120, B).astype(np.int32)
        cross, at = rng.permutation(spec.num_pages), 0
        for r, n in zip(self.rows.tolist(), self.enc.tolist()):
            for p in pools:
                p.cross_table.assign(r, cross[at : at + -(-n // PS)].tolist())
            at += -(-n // PS)
        self.kv = rng.integers(10, 200, B).astype(np.int32)
        need = -(-(self.kv + room) // PS)
        self.pages = np.split(rng.permutation(spec.num_pages)[: int(need.sum())].astype(np.int32), np.cumsum(need)[:-1])

    def plan(self, spec, write: bool = False):
        lists = [p[: -(-int(k) // PS)] for p, k in zip(self.pages, self.kv)]
        B = self.kv.shape[0]
        return build_plan(StepBatch.from_pages(np.ones(B, np.int32), self.kv, lists, PS,
                                               group_pages={1: CrossRows.of(self.rows, self.enc, [write] * B)}), spec)


@pytest.mark.parametrize("slots,shuffle", [(1, False), (2, False), (2, True)])
def test_the_steady_commit_of_cross_steps_is_taken_and_equals_the_general_one(slots, shuffle):
    """shuffle: each step lists the requests in another order (their encoder lengths with them): still steady (a
    backend with no chunk ranges: any encoder lengths), the same arrays and outputs as the general commit."""
    seed = fresh_seed()
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    spec = AttentionSpec(4, 2, 16, PS, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    steps, B = 24, int(rng.integers(2, 12))
    a, b = _pool(spec, slots), _pool(spec, slots)  # a defers (steady), b never
    eng = _Requests(rng, spec, (a, b), B, steps)
    caches = []
    for g in range(2):
        c = PagedKVCache.allocate(spec, "cpu")
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen))
        caches.append(c)
    first = eng.plan(spec, write=True)  # (stores the encoders: staged)
    a.commit(first).prepare(), b.commit(first)
    for i in range(steps):
        eng.kv = eng.kv + 1
        if shuffle:
            order = rng.permutation(B)
            eng.rows, eng.enc, eng.kv, eng.pages = eng.rows[order], eng.enc[order], eng.kv[order], [eng.pages[j] for j in order]
        plan = eng.plan(spec)
        assert plan.lazy and plan.lazy_cross is not None, f"seed {seed}"
        s, gens, n0, bytes_a, bytes_b = a.next_slot, list(a.generations), a.steady.commits, a.bytes_to_device, b.bytes_to_device
        sa, sb = a.commit(plan, defer=True), b.commit(plan)
        label = (f"seed {seed}", slots, i)
        steady = a.steady.commits - n0
        assert steady in (0, 1) and (steady or i < 2 * slots), label
        assert sa.slot == sb.slot == s and sa.generation == sb.generation == gens[s] + 1, label
        assert a.bytes_to_device - bytes_a == a.last_commit_bytes == b.bytes_to_device - bytes_b, label
        sa.prepare()
        assert np.array_equal(a.host_np[s], b.host_np[s]) and torch.equal(a.dev[s], b.dev[s]), label
        assert_same_arrays(step_arrays(sa), staged_arrays(a, plan, sa.padded_batch_size), label)
        if i % 6 == 5:  # per-request outputs, each pool over its own caches (the self group's and the cross group's)
            for g in range(2):
                copies = (caches[g], PagedKVCache(caches[g].k.clone(), caches[g].v.clone()))
                assert_same_outputs((sa, sb), copies, gen, (label, g))
    assert a.steady.commits >= steps - 2 * slots and b.steady.commits == 0, (seed, a.steady.commits)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_pending_cross_update_or_another_batch_takes_the_general_path_and_every_step_stays_right(slots):
    """A page appended to one of the step's cross-table rows (an update pending there: the step is staged, which
    sends it), a request leaving the batch (other encoder lengths): the commit after each is no steady one, then
    steady again; a row assigned that the steps do not read leaves them steady; the same encoder lengths in other
    rows (stored by a step between): steady commits read the new rows; every step's arrays are the host staging's."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, PS, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pool = _pool(spec, slots)
    eng = _Requests(rng, spec, (pool,), 6, 60)
    pool.commit(eng.plan(spec, write=True)).prepare()

    def step(label):
        eng.kv = eng.kv + 1
        return steady_step(pool, eng.plan(spec), (f"seed {seed}", label))

    def settle():
        assert sum(step("settle") for _ in range(2 * slots + 1)) >= 1, seed

    settle()
    table, free = pool.cross_table, list(np.flatnonzero(pool.cross_table.owner[:3000] == FREE))
    table.append(eng.rows[:1], [int(free.pop())])
    assert step("a cross update pending in a row read") == 0 and not table.pending, seed
    settle()
    table.assign(next(r for r in range(64) if table.counts[r] == 0), [int(free.pop())])
    assert step("a cross update pending in another row") == 1 and table.pending, seed
    settle()
    eng.rows, eng.enc, eng.kv, eng.pages = eng.rows[1:], eng.enc[1:], eng.kv[1:], eng.pages[1:]
    assert step("a request left") == 0, seed
    settle()
    rows = [r for r in range(64) if table.counts[r] == 0][: eng.rows.shape[0]]
    for r, n in zip(rows, eng.enc.tolist()):
        table.assign(r, [int(free.pop()) for _ in range(-(-n // PS))])
    eng.rows, eng.kv = np.array(rows, np.int32), eng.kv + 1
    pool.commit(eng.plan(spec, write=True), defer=True).prepare()  # (stores them: staged)
    assert sum(step("other rows, the same lengths") for _ in range(2 * slots + 1)) >= 1, seed


def test_a_backend_promise_on_the_encoder_lengths_bounds_steady_commits(monkeypatch):
    """A backend state's promise over the cross group's encoder lengths (SteadyTerms.cross) is checked on every
    steady commit: a step listing the same requests in another order (other encoder lengths at some position)
    takes the general path, which records the new order; the same order again is steady. The reference backend
    promises nothing, so each record gets a promise of its encoder lengths exactly (injected for the test)."""
    from mstar_attn.capture import pool as pool_module
    from mstar_attn.capture.steady import SteadyTerms
    from mstar_attn.metadata._arrays import Ranges

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, PS, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pool = _pool(spec, 1)
    eng = _Requests(rng, spec, (pool,), 6, 40)
    while np.unique(eng.enc).shape[0] < 6:  # (distinct encoder lengths: any other order moves one)
        pool = _pool(spec, 1)
        eng = _Requests(rng, spec, (pool,), 6, 40)
    monkeypatch.setattr(pool_module, "SteadyTerms", lambda scheduled: SteadyTerms(
        scheduled=scheduled, cross=Ranges(eng.enc.copy(), np.ones(6, np.uint32))))
    pool.commit(eng.plan(spec, write=True)).prepare()
    pattern = []
    for i in range(9):
        eng.kv = eng.kv + 1
        if i % 3 == 2:
            order = np.roll(np.arange(6), int(rng.integers(1, 6)))
            eng.rows, eng.enc, eng.kv, eng.pages = eng.rows[order], eng.enc[order], eng.kv[order], [eng.pages[j] for j in order]
        pattern.append(steady_step(pool, eng.plan(spec), (f"seed {seed}", i)))
    assert pattern == [0, 1, 0, 1, 1, 0, 1, 1, 0], (f"seed {seed}", pattern)


def test_a_steady_cross_step_past_the_index_region_is_refused_as_the_general_one_is():
    """Encoder lengths are no longer the record's, so the steady commit bounds the cross pages itself: after steady
    steps over short encoders, a step of as many requests reading long ones (more cross pages than a slot's index region
    holds, each stored by a step of its own) is no steady commit; the general commit refuses it with a PlanError and
    changes nothing, and the short steps go on."""
    from mstar_attn import PlanError

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, PS, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pool = pool_of(spec, max_batch_size=8, max_num_tokens=64, max_num_pages=40, device="cpu", buckets=(4,), num_slots=1,
                   max_requests=64, max_pages_per_request=40, max_encoder_tokens=4000)
    cap, free = pool.layout.index_capacity, list(rng.permutation(3000).astype(np.int32))
    short_rows, long_rows = np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32)
    short_enc = rng.integers(1, 4 * PS, 4).astype(np.int32)  # (at most 4 pages each)
    long_enc = np.full(4, (cap // 4 + 1) * PS, np.int32)  # (past the index region together, not alone)
    for r, n in zip(np.concatenate([short_rows, long_rows]).tolist(), np.concatenate([short_enc, long_enc]).tolist()):
        pool.cross_table.assign(r, [int(free.pop()) for _ in range(-(-n // PS))])
    own = [[int(free.pop()) for _ in range(4)] for _ in range(4)]  # (the decoder's pages: 4 a request)

    def plan(rows, enc, kv, write):
        B = rows.shape[0]
        lists = [p[: -(-int(k) // PS)] for p, k in zip(own, kv)]
        return build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, lists, PS,
                                               group_pages={1: CrossRows.of(rows, enc, [write] * B)}), spec)

    for r, n in zip(long_rows.tolist(), long_enc.tolist()):  # (each long encoder stored by a step of one request)
        pool.commit(plan(np.array([r], np.int32), np.array([n], np.int32), np.array([3], np.int32), True)).prepare()
    kv = rng.integers(2, 8, 4).astype(np.int32)
    pool.commit(plan(short_rows, short_enc, kv, True)).prepare()
    steady = []
    for _ in range(3):
        kv = kv + 1
        steady.append(steady_step(pool, plan(short_rows, short_enc, kv, False), (f"seed {seed}", "short")))
    assert steady[-1] == 1, (f"seed {seed}", steady)
    s, gens, commits = pool.next_slot, list(pool.generations), pool.steady.commits
    with pytest.raises(PlanError, match="pages, more than the pool holds"):
        pool.commit(plan(long_rows, long_enc, kv + 1, False), defer=True)
    assert (pool.next_slot, list(pool.generations), pool.steady.commits) == (s, gens, commits), seed
    kv = kv + 1
    assert steady_step(pool, plan(short_rows, short_enc, kv, False), (f"seed {seed}", "after")) == 1, seed  # (kept)
