"""capture/graph_cache.py on the CPU: a derived StepRows commit with defer=True leaves its device work
for the step's first use (a run / write_kv, step.prepare(), or the next commit), and deferred work
is launched in commit order, so the device table and every step's arrays stay right however the
engine interleaves commits and uses. Arrays are checked per step against the same step given by
pages and staged on the host; outputs per request against the same step committed without defer."""

import numpy as np
import pytest
import torch

from mstar_attn import PagedKVCache, StepBatch, build_plan
from mstar_attn.kernels import reference
from mstar_attn.metadata.batch import StepRows
from tests.capture.test_derive import GROUPS, _arrays
from tests.capture.test_table import admit, table_pool
from tests.helpers import fresh_seed, spec_for


def _same_arrays(step, ref_step, B: int, label) -> None:
    got, ref = _arrays(step), _arrays(ref_step)
    assert np.array_equal(got[0], ref[0]), label
    for g, (a, b) in enumerate(zip(got[1:], ref[1:])):
        for i in (0, 1, 2, 4):
            assert np.array_equal(a[i], b[i]), (label, g, i)


def test_a_deferred_step_is_derived_at_its_first_use_and_not_before():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
    pool, ref_pool = table_pool(spec, width=160), table_pool(spec, width=160)
    B = 5
    kv = rng.integers(10, 200, B).astype(np.int32)
    rows, lists = admit(pool, rng, kv)
    step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
    assert pool.device_work.pending_key(step.slot, step.generation) is not None, seed
    assert not step.groups[0].kv_lens.any(), seed  # (a fresh pool's slot: nothing copied or derived yet)
    step.prepare()
    assert pool.device_work.pending_key(step.slot, step.generation) is None, seed
    ref = ref_pool.commit(build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, lists, 4), spec))
    _same_arrays(step, ref, B, seed)
    step.prepare()  # (a second prepare launches nothing)
    _same_arrays(step, ref, B, seed)


def test_deferred_commits_used_late_or_never_keep_the_table_and_every_step_right():
    """Two slots (and one): derived decode steps committed with defer=True while pages are released and
    assigned between them; each step is used at once, after the next commit, or never. Every used
    step's arrays equal the same step by pages; the device table equals the host mirror at the end."""
    for slots in (2, 1):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
        pool, ref_pool = table_pool(spec, width=160, num_slots=slots), table_pool(spec, width=160)
        B = int(rng.choice([3, 5, 6]))
        kv = rng.integers(10, 200, B).astype(np.int32)
        rows, _ = admit(pool, rng, kv + 40)
        free = iter(rng.permutation(np.flatnonzero(pool.table.owner[:-1] == -1)).astype(np.int32))
        waiting = None  # (the step committed last and not used yet, and its reference)
        for i in range(24):
            kv = kv + 1
            if rng.random() < 0.5:  # a row's pages from the one this step writes on replaced by others
                r = int(rng.integers(B))
                c, need = int(pool.table.counts[rows[r]]), -(-int(kv[r]) // 4)
                pool.table.release(int(rows[r]), keep=need - 1)
                pool.table.assign(int(rows[r]), [next(free) for _ in range(c - need + 1)])
            pages = [pool.table.pages(int(r))[: -(-int(k) // 4)] for r, k in zip(rows, kv)]
            ref = ref_pool.commit(build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, pages, 4), spec))
            ref_arrays = _arrays(ref)
            step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)
            if waiting is not None and waiting[0].live:  # used after the next commit (launched by it)
                assert pool.device_work.pending_key(waiting[0].slot, waiting[0].generation) is None, (seed, i)
                waiting[0].prepare()
                for g, (a, b) in enumerate(zip(_arrays(waiting[0])[1:], waiting[1][1:])):
                    for j in (0, 1, 2, 4):
                        assert np.array_equal(a[j], b[j]), (seed, slots, i, "late", g, j)
            use = rng.choice(["now", "late", "never"])
            if use == "now":
                step.prepare()
                got = _arrays(step)
                for g, (a, b) in enumerate(zip(got[1:], ref_arrays[1:])):
                    for j in (0, 1, 2, 4):
                        assert np.array_equal(a[j], b[j]), (seed, slots, i, g, j)
            waiting = (step, ref_arrays) if use == "late" else None
        pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True).prepare()
        table = pool.table
        assert torch.equal(table.dev[:-1], torch.from_numpy(table.flat)), (seed, slots)


def test_an_eager_run_launches_the_deferred_work_first():
    """The reference backend's write_kv and run on a deferred step, per request against the same step
    committed without defer (both pools' caches written by their own step)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
    pools = [table_pool(spec, width=160), table_pool(spec, width=160)]
    B = 4
    kv = rng.integers(10, 120, B).astype(np.int32)
    rows, _ = admit(pools[0], rng, kv)
    for r in rows:
        pools[1].table.assign(int(r), pools[0].table.pages(int(r)))
    cache = PagedKVCache.allocate(spec, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    caches = [cache, PagedKVCache(cache.k.clone(), cache.v.clone())]
    q = torch.randn(B, spec.num_qo_heads, spec.head_dim, generator=gen)
    k, v = (torch.randn(B, spec.num_kv_heads, spec.head_dim, generator=gen) for _ in range(2))
    outs = []
    for pool, c, defer in zip(pools, caches, (True, False)):
        step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=defer)
        reference.write_kv(step, k, v, c, 0)
        outs.append(reference.run(step, q, c, 0))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v), seed
    for i in range(B):
        assert torch.equal(outs[0][i], outs[1][i]), (seed, i)


def test_no_garbage_is_collected_during_a_capture(monkeypatch):
    """capture_into turns the collector off for the capture and back on after it, also when the captured
    function raises (checked on the CPU with torch.cuda.graph stubbed)."""
    import contextlib
    import gc

    from mstar_attn.capture import graph_cache

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(graph_cache.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    assert graph_cache.capture_into(None, None, lambda: (seen.append(gc.isenabled()), 7)[1]) == 7
    assert seen == [False, False] and gc.isenabled()

    def boom():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        graph_cache.capture_into(None, None, boom)
    assert gc.isenabled()
