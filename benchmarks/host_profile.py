"""GPU host: where the host µs of one decode step go (a diagnosis aid beside host_step.py, no targets).

Per B: StepRows.decode, build_plan and commit(defer=True) timed alone (medians), FlashInfer plan() on
the same lengths, the StepBatch path's build_plan and commit alone, then a cProfile of the StepRows and
StepBatch steps (top functions by own time), and the per-call cost of the primitives a step is made of.
Run on the GPU: python -m benchmarks.host_profile OUT_DIR   (writes host_profile_h100.txt)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.host_step import PS, Engine, one_layer, table_pool
from benchmarks.timing import host_us
from benchmarks import cases
from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, build_plan
from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES, GraphBufferPool
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.metadata.batch import StepRows, bucket_of

import flashinfer  # noqa: E402


def per_call(fn, n=2000) -> float:
    """Median µs per call of fn over 5 rounds of n calls."""
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def profile(fn, after, n=1000) -> str:
    pr = cProfile.Profile()
    for _ in range(n):
        pr.enable()
        r = fn()
        pr.disable()
        after(r)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    return s.getvalue()


def main(out_dir: str) -> None:
    log = []
    say = lambda *a: (print(*a, flush=True), log.append(" ".join(str(x) for x in a)))  # noqa: E731
    spec = AttentionSpec(32, 8, 128, PS, cases.NUM_PAGES)
    cache = PagedKVCache.allocate(spec, "cuda")
    ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for B in (1, 8, 64):
        pool = table_pool(spec, buckets=(bucket_of(B),))
        eng = Engine(pool, B, 2048, seed=B, room=1500)
        graphs = one_layer(pool, cache)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)

        def after(step):
            graphs(step, q=q)
            torch.cuda.synchronize()
        for _ in range(4):
            after(eng.step_only())
        rows, kv = eng.rows, eng.kv
        t = {}
        t["decode"] = statistics.median(host_us(lambda: StepRows.decode(rows, kv)))
        st = StepRows.decode(rows, kv)
        t["build_plan"] = statistics.median(host_us(lambda: build_plan(st, spec)))

        def commit_only():
            if eng.kv[0] > eng.start[0] + 1200:  # (the pages given up front hold 1,500 more tokens)
                eng.kv[:] = eng.start
            eng.kv += 1
            return pool.commit(build_plan(StepRows.decode(rows, eng.kv), spec), defer=True)
        t["step"] = statistics.median(host_us(commit_only, after=after))
        plans = []

        def pre():
            if eng.kv[0] > eng.start[0] + 1200:
                eng.kv[:] = eng.start
            eng.kv += 1
            plans.append(build_plan(StepRows.decode(rows, eng.kv), spec))
        pre()
        t["commit"] = statistics.median(host_us(lambda: pool.commit(plans[-1], defer=True), after=lambda s: (after(s), pre())))
        batch = eng.csr()
        bplan = build_plan(batch, spec)
        t["batch_build_plan"] = statistics.median(host_us(lambda: build_plan(batch, spec)))
        old_pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages))

        def run_old(step):
            step.mark_stored(cache)
            fi.run(step, q, cache)
            torch.cuda.synchronize()
        t["batch_commit"] = statistics.median(host_us(lambda: old_pool.commit(bplan), after=run_old))
        p = build_plan(batch, spec)
        args = (torch.from_numpy(p.kv_indptr.copy()), torch.from_numpy(p.kv_indices.copy()).to("cuda"),
                torch.from_numpy(p.kv_last_page_len.copy()))
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        kw = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.sm_scale)
        t["flashinfer_plan"] = statistics.median(host_us(lambda: raw.plan(*args, 32, 8, 128, PS, **kw),
                                                         after=lambda _: (raw.run(q, (cache.k, cache.v)), torch.cuda.synchronize())))
        say(f"B={B} " + " ".join(f"{k}={v:.1f}" for k, v in t.items()))
        say(f"--- cProfile, StepRows step B={B}")
        say(profile(commit_only, after))
        say(f"--- cProfile, StepBatch build_plan + commit B={B}")
        say(profile(lambda: old_pool.commit(build_plan(batch, spec)), run_old, 400))
    # primitives
    x8 = np.arange(8, dtype=np.int32)
    ev = torch.cuda.Event()
    s = torch.cuda.current_stream()
    pin = torch.zeros(4096, dtype=torch.int32, pin_memory=True)
    dev = torch.zeros(4096, dtype=torch.int32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dev[:16].copy_(pin[:16], non_blocking=True)
    torch.cuda.synchronize()
    prim = {
        "np.min [8]": lambda: x8.min(),
        "int(np.max [8])": lambda: int(x8.max()),
        "np.cumsum out [8]": lambda: np.cumsum(x8),
        "pinned numpy write [8]": lambda: pin.numpy().__setitem__(slice(0, 8), x8),
        "torch._C._cuda_getCurrentStream": lambda: torch._C._cuda_getCurrentStream(0),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "Event.record": lambda: ev.record(s),
        "Event.query": lambda: ev.query(),
        "copy_ pinned->dev 64 B": lambda: dev[:16].copy_(pin[:16], non_blocking=True),
        "graph replay (1 memcpy node)": lambda: g.replay(),
        "tensor slice dev[:16]": lambda: dev[:16],
    }
    for name, fn in prim.items():
        say(f"{name}: {per_call(fn):.2f} us")
        torch.cuda.synchronize()
    open(f"{out_dir}/host_profile_h100.txt", "w").write("\n".join(log) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
