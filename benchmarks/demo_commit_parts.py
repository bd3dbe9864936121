"""GPU: each demo's commits taken apart, step by step: build_plan and commit µs, and inside commit the µs and calls of
validate, free_slot, views_of, stage_pages, shapes_of, copy_ranges, the cross-table check / stage / device work,
FlashInfer's schedule, FastDecodePlan.replan / remember and FlashInfer's public plan() (timing wrappers around each,
~1 µs apiece). A diagnosis aid, no targets. Run on the GPU: python -m benchmarks.demo_commit_parts llama gemma2 bart
"""
import sys, time, statistics
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import flashinfer as fimod
from mstar_attn.kernels import _flashinfer_fast as fast
from mstar_attn.demo.run import run_demo
from mstar_attn.demo.config import DemoConfig
import flashinfer

REC, CUR = [], None
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def w(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return orig(*a, **k)
        finally:
            if CUR is not None:
                CUR[key] = CUR.get(key, 0) + (time.perf_counter_ns() - t0) / 1e3
                CUR[key + "#"] = CUR.get(key + "#", 0) + 1
    setattr(obj, name, w)

orig_commit = GraphBufferPool.commit
def commit(self, plan, **k):
    global CUR
    outer = CUR is None
    if outer:
        CUR = {"mode": plan.mode.value, "B": plan.batch_size, "T": plan.num_tokens}
    t0 = time.perf_counter_ns()
    try:
        return orig_commit(self, plan, **k)
    finally:
        if outer:
            CUR["commit"] = (time.perf_counter_ns() - t0) / 1e3
            REC.append(CUR)
            CUR = None
GraphBufferPool.commit = commit
wrap(fimod.PoolState, "schedule", "schedule")
wrap(fast.FastDecodePlan, "replan", "replan")
wrap(fast.FastDecodePlan, "remember", "remember")
for cls in (flashinfer.BatchDecodeWithPagedKVCacheWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchPrefillWithRaggedKVCacheWrapper):
    wrap(cls, "plan", "wplan_" + cls.__name__[5:12])
wrap(GraphBufferPool, "views_of", "views_of")
wrap(GraphBufferPool, "free_slot", "free_slot")
from mstar_attn.capture import checks, cross
wrap(checks, "validate", "validate")
import mstar_attn.capture.pool as P
for n in ("stage_pages", "shapes_of", "copy_ranges"):
    if hasattr(P, n): wrap(P, n, n)
for n in ("stage", "device_work", "check"):
    wrap(cross, n, "cross_" + n)

for model in sys.argv[1:]:
    REC.clear()
    res = run_demo(DemoConfig(model=model))
    print(f"== {model}: steps {res.steps}; plan_us median {statistics.median(res.plan_us):.0f}; commit median {statistics.median(res.commit_us):.0f}; graph median {statistics.median(res.graph_us):.0f}")
    recs = REC[-res.steps:]
    keys = sorted({k for r in recs for k in r if k not in ("mode", "B", "T")})
    print("mode B T plan " + " ".join(keys))
    for r, p in zip(recs, res.plan_us):
        print(r["mode"], r["B"], r["T"], f"{p:.0f}", " ".join(f"{r.get(k, 0):.0f}" for k in keys))
    tot = [p + r["commit"] for r, p in zip(recs, res.plan_us)]
    print("median plan+commit", statistics.median(tot), "n recs", len(REC))
