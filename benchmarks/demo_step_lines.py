"""GPU host: a demo-shaped StepBatch decode step (8 / 2 heads of 64, page 4, B = 4, 20-40 tokens, one FlashInfer
layer's decode graph) timed in a tight loop (build_plan, commit), a few primitives it is made of (FastDecodePlan.remember,
a 256-byte upload, an event record, the current stream), then line_profiler over its functions for 2,000 steps at
fixed lengths (`walk`: walking lengths). line_profiler is not a dependency: the device carries it (PYTHONPATH).
A diagnosis aid, no targets. Run on the GPU: python -m benchmarks.demo_step_lines [walk]
"""
import io, sys, time, statistics
import numpy as np, torch
from line_profiler import LineProfiler
from mstar_attn import build_plan
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.capture import checks, lease, stage, step as stp, cross
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.metadata import listed, plan as pl, pages, record
from mstar_attn.metadata.batch import StepBatch
from benchmarks.demo_shape import B, PS, decode_pool

B, ps = B, PS
spec, cache, pool, graphs = decode_pool()
rng = np.random.default_rng(0)
kv = rng.integers(20, 40, B).astype(np.int32); need = (kv + ps - 1) // ps + 30
perm = rng.permutation(4000).astype(np.int32); at = 0; pgs = []
for n in need: pgs.append(perm[at:at + n]); at += n
q = torch.randn(B, 8, 64, device="cuda", dtype=torch.bfloat16)
def batch_of(k):
    return StepBatch.from_pages(np.ones(B, np.int32), k, [p[: -(-int(x) // ps)] for p, x in zip(pgs, k)], ps)
b0 = batch_of(kv)
def one(b):
    st = pool.commit(build_plan(b, spec))
    graphs(st, q=q)
for _ in range(50): one(b0)
torch.cuda.synchronize()
# timing: fixed lengths (kept plans hold) and walking lengths
def timeit(fn, n=400):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e6)
    return round(statistics.median(ts), 1)
plan0 = build_plan(b0, spec)
print("build_plan", timeit(lambda: build_plan(b0, spec)), "commit", timeit(lambda: pool.commit(plan0)))
w = pool.commit(plan0).scheduled[0]
fp = next(iter(pool.backend_state("flashinfer").fast.values()))
info = fp.wrapper._plan_info
print("type info", type(info), "int(info[7])", timeit(lambda: int(info[7]), 2000), "remember", timeit(fp.remember, 2000))
h = pool.host[0]; d = pool.dev[0]
print("upload 256B", timeit(lambda: d[50:114].copy_(h[50:114], non_blocking=True), 2000), "slice", timeit(lambda: (d[50:114], h[50:114]), 2000))
ev = torch.cuda.Event()
print("event record", timeit(lambda: ev.record(), 2000), "current_stream", timeit(lambda: torch.cuda.current_stream(), 2000))
lp = LineProfiler()
P = GraphBufferPool
for f in (P.commit, P._commit_staged, P.free_slot, checks.validate, stage.stage_pages, stage.stage_requests, stage.copy_ranges,
          lease.SlotLeases.free, lease.SlotLeases.record, lease.SlotLeases.after_consumer, lease.SlotLeases.claim_consumer,
          stp.DeviceStep.__init__, fi.PoolState.schedule, fi.PoolState._kept, pl.build_plan, listed.plan_listed_decode,
          pages.scan_ownership, record.AttentionPlan.listed_decode, cross.rows_group):
    lp.add_function(f)
ks = [kv + i for i in range(8)]
def loop():
    for i in range(2000):
        st = pool.commit(build_plan(batch_of(ks[i % 8] if sys.argv[1:] == ["walk"] else kv), spec))
        graphs(st, q=q)
        torch.cuda.synchronize()
lp.runcall(loop)
t = io.StringIO(); lp.print_stats(stream=t, output_unit=1e-6, stripzeros=True)
print(t.getvalue())
