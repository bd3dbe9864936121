"""GPU host: a demo-shaped StepBatch decode step's host µs (building the StepBatch, build_plan, commit) after four kinds
of work between steps, the kinds taking turns step by step: none ("plain"), waiting out ~0.5 ms of GPU work
("gpu_wait"), touching 32 MB ("mem"), iterating 200k Python dicts ("py_objs"). Separates cold caches from waits on the
GPU as the cause of the demos' host times (8 / 2 heads of 64, page 4, B = 4, 20-40 tokens, one decode graph of one
FlashInfer layer). A diagnosis aid, no targets. Run on the GPU: python -m benchmarks.cold_host (prints medians).
"""
import time, statistics
import numpy as np, torch
from mstar_attn import build_plan
from mstar_attn.metadata.batch import StepBatch
from benchmarks.demo_shape import B, PS, decode_pool
B, ps = B, PS
spec, cache, pool, graphs = decode_pool()
rng = np.random.default_rng(0)
kv = rng.integers(20, 40, B).astype(np.int32)
perm = rng.permutation(4000).astype(np.int32)
pgs = [perm[i * 40:(i + 1) * 40] for i in range(B)]
q = torch.randn(B, 8, 64, device="cuda", dtype=torch.bfloat16)
big = np.zeros(4 << 20, np.int64)  # 32 MB
objs = [dict(a=i, b=str(i)) for i in range(200000)]
def batch():
    return StepBatch.from_pages(np.ones(B, np.int32), kv, [p[: -(-int(x) // ps)] for p, x in zip(pgs, kv)], ps)
res = {}
for i in range(3000):
    mode = ("plain", "gpu_wait", "mem", "py_objs")[i % 4]
    if mode == "gpu_wait":
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU time the host waits out
    elif mode == "mem":
        big += 1
    elif mode == "py_objs":
        s = 0
        for o in objs:
            s += o["a"]
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns(); b = batch(); t1 = time.perf_counter_ns(); p = build_plan(b, spec); t2 = time.perf_counter_ns()
    st = pool.commit(p); t3 = time.perf_counter_ns()
    graphs(st, q=q)
    if i >= 400:
        r = res.setdefault(mode, ([], [], []))
        r[0].append((t1 - t0) / 1e3); r[1].append((t2 - t1) / 1e3); r[2].append((t3 - t2) / 1e3)
for mode, (a, b_, c) in res.items():
    print(f"{mode}: StepBatch {statistics.median(a):.1f} build_plan {statistics.median(b_):.1f} commit {statistics.median(c):.1f}", flush=True)
