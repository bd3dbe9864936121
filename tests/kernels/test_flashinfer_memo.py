"""FlashInfer split-KV plans kept while every request's KV chunk count holds (FastDecodePlan.holds), on
the GPU: decode steps walking lengths across chunk and page boundaries, replayed, per request
against the reference; some steps reuse the plan, some plan again; a plan reused past a changed
count (the negative control) is caught. Committed with defer=True, the steps whose counts hold are
steady commits (capture/steady.py, PoolState.steady's chunk ranges): the same checks, and a steady
record that ignores the chunk ranges (its negative control) is caught too (GPU only)."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, PoolLimits, StepBatch, build_plan
from mstar_attn.kernels import reference
from mstar_attn.metadata.batch import StepRows
from tests.helpers import GPU_GROUPS, assert_close_per_request, attend_filled, disjoint, fresh_seed, marked, random_cache

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import _flashinfer_fast  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402


def _table_graphs(spec, cache, max_batch: int):
    """A pool with a page table (8 rows of 128 pages, one bucket of 4: split-KV) and its captured
    decode graphs of fi.run over `cache`."""
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=max_batch, max_num_tokens=64, max_num_pages=spec.num_pages,
                                            buckets=(4,), max_requests=8, max_pages_per_request=128))
    q = torch.zeros(4, spec.num_qo_heads, spec.head_dim, device="cuda", dtype=torch.bfloat16)
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": q})
    graphs.capture()
    return pool, graphs


def _walk(seed: int, steps: int, tensor_cores: bool, defer: bool = False, pools: list | None = None, stride: int = 40,
          lists: bool = False):
    """Decode `steps` steps of 3 requests (bucket 4: split-KV) from random lengths, 1 .. stride - 1 tokens a step,
    committed with `defer` (lists: as StepBatch steps listing the rows' pages). Yields (plan, the replayed output,
    the reference's); the pool is appended to `pools`."""
    rng = np.random.default_rng(seed)
    heads = (32, 8) if tensor_cores else (8, 8)  # GQA 4: tensor cores; MHA: FlashInfer's CUDA-core decode
    spec = AttentionSpec(heads[0], heads[1], 128, 16, 600, groups=GPU_GROUPS[:2])
    cache = random_cache(spec, seed)
    pool, graphs = _table_graphs(spec, cache, 4)
    if pools is not None:
        pools.append(pool)
    kv = rng.integers(100, 1500, 3).astype(np.int32)
    free = list(rng.permutation(600).astype(np.int32))
    for r, k in enumerate(kv):
        pool.table.assign(r, [free.pop() for _ in range(127)])  # (room for the walk: at most 127 pages)
    q = torch.randn(3, heads[0], 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        kv += rng.integers(1, stride, 3).astype(np.int32)  # (several tokens a step: chunk boundaries come sooner)
        kv = np.minimum(kv, 127 * 16)
        plan = build_plan(StepBatch.from_pages(np.ones(3, np.int32), kv, [pool.table.pages(r)[: -(-int(k) // 16)]
                                                                         for r, k in enumerate(kv)], 16) if lists
                          else StepRows.decode(np.arange(3, dtype=np.int32), kv), spec)
        step = marked(pool.commit(plan, defer=defer), cache)  # (random K/V already at every slot)
        out = graphs(step, q=q)[:3].clone()
        yield plan, out, reference.run(step, q.float(), cache)


@pytest.mark.parametrize("tensor_cores,defer,lists", [(True, False, False), (False, False, False), (True, True, False),
                                                      (False, True, False), (True, True, True), (False, True, True)])
def test_a_split_plan_is_reused_while_the_chunk_counts_hold(tensor_cores, defer, lists, monkeypatch):
    seed = fresh_seed()
    planned, pools = [], []
    replan = _flashinfer_fast.FastDecodePlan.replan
    monkeypatch.setattr(_flashinfer_fast.FastDecodePlan, "replan", lambda self, *a: (planned.append(1), replan(self, *a)))
    n = 0
    # (deferred: a few tokens a step, so that a slot's chunk counts often hold from one of its commits to the next)
    for plan, out, want in _walk(seed, 40, tensor_cores, defer, pools, 5 if defer else 40, lists):
        assert_close_per_request(out, want, plan, torch.bfloat16, f"seed {seed}, step {n}")
        n += 1
    assert 0 < len(planned) < n, (f"seed {seed}", len(planned), n)  # both paths ran
    steady = pools[0].steady.commits
    assert (0 < steady < n) if defer else steady == 0, (f"seed {seed}", steady, len(planned), n)


@pytest.mark.parametrize("lists", [False, True], ids=["rows", "lists"])
def test_a_steady_record_past_a_changed_chunk_count_is_caught(lists, monkeypatch):
    """The steady commit's negative control: with PoolState.steady promising its wrappers for any lengths
    (its chunk ranges dropped), some steady step's output is wrong (StepRows steps, or StepBatch steps listing
    their pages)."""
    seed = fresh_seed()
    promise = fi.PoolState.steady
    monkeypatch.setattr(fi.PoolState, "steady", lambda self, step: None if (t := promise(self, step)) is None
                        else type(t)(scheduled=t.scheduled))
    wrong, pools = 0, []
    for plan, out, want in _walk(seed, 40, True, True, pools, lists=lists):
        try:
            assert_close_per_request(out, want, plan, torch.bfloat16, f"seed {seed}")
        except AssertionError:
            wrong += 1
    assert wrong > 0 and pools[0].steady.commits > 0, f"seed {seed}"


def test_a_plan_reused_past_a_changed_chunk_count_is_caught(monkeypatch):
    """The negative control: with the check forced to say yes once the wrapper was planned, some step's output
    is wrong."""
    seed = fresh_seed()
    monkeypatch.setattr(_flashinfer_fast.FastDecodePlan, "holds", lambda self, lens: self.chunks.ranges is not None)
    wrong = 0
    for plan, out, want in _walk(seed, 40, True):
        try:
            assert_close_per_request(out, want, plan, torch.bfloat16, f"seed {seed}")
        except AssertionError:
            wrong += 1
    assert wrong > 0, f"seed {seed}"


def test_a_kept_plan_holds_while_other_wrappers_plan_in_its_slot(monkeypatch):
    """Bucketed decode steps over the same lengths alternate the two slots; an unbucketed decode step
    (past the bucket) in between plans into slot 0's shared int workspace. The graph-mode wrapper plans into
    an int workspace of its own, so slot 0's next bucketed step keeps its plan (no re-plan) and still reads
    its own work list: every output per request against the reference."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(32, 8, 128, 16, 600, groups=GPU_GROUPS[:1])
    cache = random_cache(spec, seed)
    pool, graphs = _table_graphs(spec, cache, 8)
    free = list(rng.permutation(600).astype(np.int32))
    for r in range(6):
        pool.table.assign(r, [free.pop() for _ in range(80)])
    kv = rng.integers(600, 1200, 6).astype(np.int32)
    planned = []
    replan = _flashinfer_fast.FastDecodePlan.replan
    monkeypatch.setattr(_flashinfer_fast.FastDecodePlan, "replan", lambda self, *a: (planned.append(1), replan(self, *a)))
    q = torch.randn(6, 32, 128, device="cuda", dtype=torch.bfloat16)
    last = {}  # slot -> what its previous step was: "bucketed" or "eager"
    kept = after_eager = 0
    sched = pool.backend_state("flashinfer")
    for i, B in enumerate([3, 3, 3, 3, 6, 3, 3, 3]):  # the slots alternate; step 4 (B 6) runs unbucketed
        plan = build_plan(StepRows.decode(np.arange(B, dtype=np.int32), kv[:B]), spec)
        before = len(planned)
        step = marked(pool.commit(plan), cache)  # (random K/V already at every slot)
        out = (graphs(step, q=q[:B]) if graphs.serves(step) else fi.run(step, q[:B], cache))[:B].clone()
        assert_close_per_request(out, reference.run(step, q[:B].float(), cache), plan, torch.bfloat16, f"seed {seed}, step {i}")
        if step.bucket is None:  # the eager wrapper plans into the slot's shared int workspace, the graph one never
            w = step.scheduled[0]
            assert w._int_workspace_buffer is sched.int_ws[step.slot][0], (f"seed {seed}", i)
            assert all(disjoint((w._int_workspace_buffer, f.wrapper._int_workspace_buffer))  # (no byte of a graph
                       for f in sched.fast.values()), (f"seed {seed}", i)                    # wrapper's own in it)
        if step.bucket is not None and last.get(step.slot) is not None:  # same lengths: kept, after an eager step too
            assert len(planned) == before, (f"seed {seed}", i, last[step.slot])
            kept += 1
            after_eager += last[step.slot] == "eager"
        last[step.slot] = "bucketed" if step.bucket is not None else "eager"
    assert kept >= 3 and after_eager == 1, (f"seed {seed}", kept, after_eager)


def _shuffled(seed: int, steps: int, lists: bool, pools: list):
    """Decode `steps` steps over 4 requests of a bucket of 4 (split-KV, MHA: the CUDA-core planner), each step a
    random number of them (1 .. 4) in a random order, each advancing 1 .. 3 tokens: three short ones (one KV chunk
    each at first, as a padding request's) and a long one (several chunks), committed deferred as StepRows or as
    StepBatch steps listing their pages. Yields (the step's slot, its requests, plan, the replayed output, the
    reference's). (No
    negative control drops the padding requests' counts: a chunk past a request's length is an out-of-bounds read
    in FlashInfer's kernel, not a wrong output.)"""
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(8, 8, 128, 16, 600, groups=GPU_GROUPS[:1])
    cache = random_cache(spec, seed)
    pool, graphs = _table_graphs(spec, cache, 4)
    pools.append(pool)
    kv = np.concatenate([rng.integers(10, 80, 3), rng.integers(400, 900, 1)]).astype(np.int32)
    free = list(rng.permutation(600).astype(np.int32))
    for r in range(4):
        pool.table.assign(r, [free.pop() for _ in range(70)])
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        rows = rng.permutation(4)[: int(rng.integers(1, 5))].astype(np.int32)
        kv[rows] += rng.integers(1, 4, rows.shape[0]).astype(np.int32)
        lens = kv[rows]
        plan = build_plan(StepBatch.from_pages(np.ones(rows.shape[0], np.int32), lens,
                                               [pool.table.pages(int(r))[: -(-int(k) // 16)] for r, k in zip(rows, lens)], 16)
                          if lists else StepRows.decode(rows, lens), spec)
        step = marked(pool.commit(plan, defer=True), cache)
        B = rows.shape[0]
        out = graphs(step, q=q[:B])[:B].clone()
        yield step.slot, tuple(rows.tolist()), plan, out, reference.run(step, q[:B].float(), cache)


@pytest.mark.parametrize("lists", [False, True], ids=["rows", "lists"])
def test_a_split_plan_holds_for_other_orders_and_batch_sizes_of_the_same_counts(lists, monkeypatch):
    """ChunkRanges over the bucket's rows: a step of another number of requests (or other requests, in another order)
    keeps the slot's plan where every request's KV chunk count (a padding request's past the batch) is the plan's;
    every output per request against the reference; some steps of another batch size than the slot's last kept its
    plan, some steps planned again."""
    seed = fresh_seed()
    planned, pools, kept = [], [], 0
    replan = _flashinfer_fast.FastDecodePlan.replan
    monkeypatch.setattr(_flashinfer_fast.FastDecodePlan, "replan", lambda self, *a: (planned.append(1), replan(self, *a)))
    last, before = {}, 0  # slot -> the requests of its last step
    for n, (s, rows, plan, out, want) in enumerate(_shuffled(seed, 80, lists, pools)):
        assert_close_per_request(out, want, plan, torch.bfloat16, f"seed {seed}, step {n}")
        if s in last and len(last[s]) != len(rows) and len(planned) == before:  # (another batch size, the plan kept)
            kept += 1
        last[s], before = rows, len(planned)
    assert kept > 0 and 0 < len(planned) < 80, (f"seed {seed}", kept, len(planned))



def test_encoder_decoder_steps_in_another_order_stay_steady_where_the_encoder_chunk_counts_hold():
    """A split bucket of encoder-decoder decode steps (a self group and a cross group of cross-table rows, MHA: the
    CUDA-core planner): two short encoders (one KV chunk each) and two long ones of different chunk counts, each step
    the four requests in one of three orders (as stored, the short ones swapped, the long ones swapped), committed
    deferred and replayed. A steady commit takes a step whose encoder lengths differ from its slot's record wherever
    every position's chunk count is the record's (PoolState.steady's SteadyTerms.cross), and never otherwise; the long
    ones swapped take the general commit, which plans again; both groups' outputs per request against the reference."""
    import attrs

    from mstar_attn import CrossRows
    from tests.support.cross_pages import GROUPS

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(8, 8, 128, 16, 2000, groups=GROUPS, layer_groups=(0, 1))
    caches = [attrs.evolve(random_cache(spec, seed + g), group=g) for g in range(2)]
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=64, max_num_pages=spec.num_pages, buckets=(4,),
                                            max_requests=16, max_pages_per_request=128, max_encoder_tokens=4000))

    def layers(step, x):
        marked(step, *caches)  # (random K/V already at every slot, the encoders' too)
        return torch.stack([fi.run(step, x["q"], caches[g], group=g) for g in range(2)], dim=1)

    graphs = DecodeGraphs(pool, layers, {"q": torch.zeros(4, 8, 128, device="cuda", dtype=torch.bfloat16)})
    graphs.capture()
    free = iter(rng.permutation(2000).tolist())
    enc = np.array([rng.integers(20, 120), rng.integers(20, 120), rng.integers(300, 380), rng.integers(560, 700)], np.int32)
    for r in range(4):
        pool.cross_table.assign(r, [int(next(free)) for _ in range(-(-int(enc[r]) // 16))])
    own = [[int(next(free)) for _ in range(12)] for _ in range(4)]  # (the decoder's pages: 192 tokens a request)
    kv = rng.integers(20, 70, 4).astype(np.int32)  # (the self group: one chunk each throughout)
    chunks = lambda order: tuple(-(-enc[order] // 128))  # noqa: E731  (the cross group's counts: 128-token chunks)

    def plan(order, write=False):
        return build_plan(StepBatch.from_pages(np.ones(4, np.int32), kv[order], [own[i][: -(-int(kv[i]) // 16)] for i in order],
                                               16, group_pages={1: CrossRows.of(order, enc[order], [write] * 4)}), spec)

    marked(pool.commit(plan(np.arange(4, dtype=np.int32), write=True)), *caches)  # (stores the encoders: staged)
    orders = [np.array(o, np.int32) for o in ([0, 1, 2, 3], [1, 0, 2, 3], [0, 1, 3, 2])]
    record, moved, refused = {}, 0, 0  # slot -> the order of its last general commit
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    for n in range(48):
        kv += 1
        order = orders[int(rng.choice(3, p=[0.4, 0.4, 0.2]))]
        p, commits, s = plan(order), pool.steady.commits, pool.next_slot
        kept = pool.steady.records[s] is not None  # (the slot has a steady record)
        step = marked(pool.commit(p, defer=True), *caches)
        assert step.slot == s, (f"seed {seed}", n)
        out = graphs(step, q=q)[:4].clone()
        for g in range(2):
            want = reference.run(step, q.float(), caches[g], group=g)
            assert_close_per_request(out[:, g], want, p, torch.bfloat16, (f"seed {seed}", n, g))
        if pool.steady.commits - commits:
            assert chunks(order) == chunks(record[s]), (f"seed {seed}", n, order, record[s])  # (the promise held)
            moved += not np.array_equal(enc[order], enc[record[s]])
        else:
            refused += kept and chunks(order) != chunks(record[s])
            record[s] = order
    assert moved > 0 and refused > 0, (f"seed {seed}", moved, refused)
