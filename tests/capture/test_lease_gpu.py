"""capture/lease.py on the H100: derived decode commits proven by their fence, with the GPU held behind
the host so a commit must wait for the fence of the one two steps before it; every replayed output per
request against the reference; and the negative control (slots reused without waiting) is caught. GPU only."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, PoolLimits, StepBatch, build_plan
from mstar_attn.capture import lease
from mstar_attn.kernels import reference
from mstar_attn.metadata.batch import StepRows
from tests.helpers import assert_close_per_request, attend_filled, fresh_seed, random_cache

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import _flashinfer_fast  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402

B, PAGES, PS = 64, 32, 16  # 64 requests x 8 KV heads: the fixed schedule (planned once: every commit fenced)


def _run_behind(seed: int, steps: int, defer: bool = False, churn: bool = False, graphs_out: list | None = None):
    """Decode `steps` steps, each queued behind ~10 ms of GPU sleep; returns (pool, [(plan, csr plan, output)]).
    defer: commit(defer=True) (the decode graph runs each commit's device work); churn: each step one
    request's pages past the one it writes replaced by free ones (table updates the steps then read)."""
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(32, 8, 128, PS, B * PAGES + 8)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=256, max_num_pages=spec.num_pages,
                                            buckets=(B,), max_requests=B, max_pages_per_request=PAGES))
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": torch.zeros(B, 32, 128, device="cuda",
                                                                               dtype=torch.bfloat16)})
    graphs.capture()
    free = rng.permutation(spec.num_pages).astype(np.int32)
    rows = rng.permutation(B).astype(np.int32)
    for r in range(B):
        pool.table.assign(r, free[r * PAGES : (r + 1) * PAGES - 2])  # (two spare pages per row for churn)
    spare = [int(p) for r in range(B) for p in free[(r + 1) * PAGES - 2 : (r + 1) * PAGES]]
    kv = rng.integers(50, (PAGES - 2) * PS - 3 * steps, B).astype(np.int32)
    if graphs_out is not None:
        graphs_out.append(graphs)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out = []
    for _ in range(steps):
        kv = kv + rng.integers(1, 4, B).astype(np.int32)
        torch.cuda._sleep(20_000_000)  # the GPU falls behind the host
        if churn:  # a request's pages past the one its next token lands on, replaced (read by later steps)
            i = int(rng.integers(B))
            r, keep = int(rows[i]), -(-int(kv[i]) // PS)
            if keep < pool.table.counts[r]:
                spare += [int(p) for p in pool.table.release(r, keep)]
                rng.shuffle(spare)
                pool.table.assign(r, [spare.pop() for _ in range(PAGES - 2 - keep)])
        plan = build_plan(StepRows.decode(rows, kv), spec)
        step = pool.commit(plan, defer=defer)
        pages = [pool.table.pages(int(r))[: -(-int(k) // PS)] for r, k in zip(rows, kv)]
        csr = build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, pages, PS), spec)
        out.append((plan, csr, graphs(step, q=q)[:B].clone()))
    torch.cuda.synchronize()
    return pool, cache, q, out


def _wrong_steps(out, cache, q, seed: int) -> int:
    """How many steps of a walk ([(plan, csr plan, output, ...)]) miss the reference over the same cache
    per request (what a negative control counts)."""
    wrong = 0
    for plan, csr, got, *_ in out:
        try:
            assert_close_per_request(got, reference.run(csr, q.float(), cache), plan, torch.bfloat16, f"seed {seed}")
        except AssertionError:
            wrong += 1
    return wrong


def test_fenced_commits_wait_for_the_gpu_and_every_step_is_right():
    seed = fresh_seed()
    pool, cache, q, out = _run_behind(seed, 6)
    assert all(pool.leases.fenced) and pool.stalls >= 1, (f"seed {seed}", pool.leases.fenced, pool.stalls)
    assert [int(f) for f in pool.leases.fence_np] == [g & lease.FENCE_MASK for g in pool.generations], f"seed {seed}"
    for i, (plan, csr, got) in enumerate(out):
        assert_close_per_request(got, reference.run(csr, q.float(), cache), plan, torch.bfloat16, f"seed {seed}, step {i}")


@pytest.mark.smoke
def test_deferred_commits_run_inside_the_decode_graph_and_every_step_is_right():
    """commit(defer=True) with pages changing under the walk: from each slot's second step on, the decode
    graph that first runs the commit's device work replays (one launch per step); commits still wait on
    fences, and every step is right per request."""
    seed = fresh_seed()
    graphs = []
    pool, cache, q, out = _run_behind(seed, 8, defer=True, churn=True, graphs_out=graphs)
    assert len(graphs[0].prepared) == pool.num_slots and all(pool.leases.fenced) and pool.stalls >= 1, f"seed {seed}"
    assert all(p is None for p in pool.device_work.pending), f"seed {seed}"
    for i, (plan, csr, got) in enumerate(out):
        assert_close_per_request(got, reference.run(csr, q.float(), cache), plan, torch.bfloat16, f"seed {seed}, step {i}")


def test_a_decode_graph_without_the_commit_work_is_caught(monkeypatch):
    """The negative control: a folded graph captured without the commit's device work would replay steps
    over the arrays of an earlier commit of the slot; it never writes the slot's fence either, so the
    next commit into that slot raises instead of rewriting the staging (or, failing that, some step's
    output is wrong)."""
    seed = fresh_seed()

    def forward_only(self, step, commit_work):
        static = {name: t[: step.padded_num_tokens] for name, t in self.inputs.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            out = self.fn(step, static)
        return graph, out

    monkeypatch.setattr(DecodeGraphs, "_capture_prepared", forward_only)
    monkeypatch.setattr(lease, "SPIN_SECONDS", 0.05)
    try:
        _, cache, q, out = _run_behind(seed, 8, defer=True, churn=True)
    except RuntimeError as e:
        assert "did not write fence" in str(e), f"seed {seed}: {e}"
        return
    assert _wrong_steps(out, cache, q, seed) > 0, f"seed {seed}"


def test_the_kept_current_stream_follows_stream_changes():
    spec = AttentionSpec(32, 8, 128, PS, 64)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=16, max_num_pages=64, buckets=(4,),
                                            max_requests=4))
    side = torch.cuda.Stream()
    assert pool.current_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert pool.current_stream() == side
    assert pool.current_stream() == torch.cuda.current_stream() and pool.current_stream() != side


def test_slots_reused_without_waiting_are_caught(monkeypatch):
    """The negative control: free() that never waits lets a commit overwrite a slot's staging before the
    GPU copied it; some step then runs with a later step's lengths and its output is wrong."""
    seed = fresh_seed()
    monkeypatch.setattr(lease.SlotLeases, "free", lambda self, s: None)
    _, cache, q, out = _run_behind(seed, 6)
    assert _wrong_steps(out, cache, q, seed) > 0, f"seed {seed}"


def _replanning_walk(seed: int, steps: int, monkeypatch):
    """8 requests in a bucket of 8 (split-KV: FlashInfer keeps a plan while each request's KV chunk
    count holds), lengths jumping across chunks so most commits plan again; a GPU sleep queued inside
    each re-plan, between the commit graph and the planner's copy of its pinned workspace.
    Returns (pool, cache, q, [(plan, csr plan, output, planned, fenced)])."""
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(32, 8, 128, PS, 8 * 128 + 8)
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=64, max_num_pages=spec.num_pages,
                                            buckets=(8,), max_requests=8, max_pages_per_request=128))
    graphs = DecodeGraphs(pool, attend_filled(fi.run, cache), {"q": torch.zeros(8, 32, 128, device="cuda",
                                                                               dtype=torch.bfloat16)})
    graphs.capture()
    free = rng.permutation(spec.num_pages).astype(np.int32)
    for r in range(8):
        pool.table.assign(r, free[r * 128 : (r + 1) * 128])
    rows = np.arange(8, dtype=np.int32)
    kv = rng.integers(100, 600, 8).astype(np.int32)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    planned = []
    replan = _flashinfer_fast.FastDecodePlan.replan

    def slow_replan(self, *a):
        planned.append(1)
        torch.cuda._sleep(20_000_000)  # the planner's copy runs ~10 ms after the commit graph
        replan(self, *a)

    monkeypatch.setattr(_flashinfer_fast.FastDecodePlan, "replan", slow_replan)
    torch.cuda.synchronize()
    out = []
    for _ in range(steps):
        kv = np.minimum(kv + rng.integers(40, 150, 8).astype(np.int32), 128 * PS)
        before = len(planned)
        plan = build_plan(StepRows.decode(rows, kv), spec)
        step = pool.commit(plan)
        fenced = pool.leases.fenced[step.slot]
        pages = [pool.table.pages(int(r))[: -(-int(k) // PS)] for r, k in zip(rows, kv)]
        csr = build_plan(StepBatch.from_pages(np.ones(8, np.int32), kv, pages, PS), spec)
        out.append((plan, csr, graphs(step, q=q)[:8].clone(), len(planned) > before, fenced))
    torch.cuda.synchronize()
    return pool, cache, q, out


def test_a_commit_that_planned_on_the_host_is_proven_by_an_event_and_every_step_is_right(monkeypatch):
    seed = fresh_seed()
    pool, cache, q, out = _replanning_walk(seed, 8, monkeypatch)
    assert sum(p for *_, p, _ in out) >= 4, f"seed {seed}"  # (most commits planned again)
    for i, (plan, csr, got, planned, fenced) in enumerate(out):
        assert not (planned and fenced), f"seed {seed}, step {i}: a commit that planned was fenced"
        assert_close_per_request(got, reference.run(csr, q.float(), cache), plan, torch.bfloat16, f"seed {seed}, step {i}")


def test_planner_buffers_reused_without_waiting_are_caught(monkeypatch):
    """The negative control: with free() never waiting, the next plan into a slot rewrites the planner's
    pinned workspace before the delayed copy of the last one ran; some step's output is then wrong."""
    seed = fresh_seed()
    monkeypatch.setattr(lease.SlotLeases, "free", lambda self, s: None)
    _, cache, q, out = _replanning_walk(seed, 8, monkeypatch)
    assert _wrong_steps(out, cache, q, seed) > 0, f"seed {seed}"
