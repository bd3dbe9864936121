"""Host µs of each phase of a StepRows decode step on the GPU machine, each timed alone (2,000 calls,
median of 5 rounds), beside FlashInfer's plan() and the floor the issue measured (two reductions,
two staging writes, one graph replay, one event record). Run: python -m benchmarks.step_phases OUT_DIR"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from benchmarks import cases
from benchmarks.host_step import Engine, table_pool
from mstar_attn import build_plan
from mstar_attn.metadata.batch import StepRows


def per_call(fn, n=2000, rounds=5) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(out_dir: str) -> None:
    import flashinfer

    spec = cases.spec("flashinfer")
    res = {}
    for B in (8, 256):
        pool = table_pool(spec)
        eng = Engine(pool, B, 2048, seed=B, room=200)
        for _ in range(4):
            eng.step_only()
        rows, kv = eng.rows, eng.kv.copy()
        sr = StepRows.decode(rows, kv)
        plan = build_plan(sr, spec)
        table, sched = pool.table, pool.scheduler_for("flashinfer")
        step = pool.commit(plan)
        graph = next(iter(pool.device_work.graphs.values()))
        h = pool.host_np[0]
        ev = torch.cuda.Event()
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        csr = build_plan(eng.csr(), spec)
        args = (torch.from_numpy(csr.kv_indptr.copy()), torch.from_numpy(csr.kv_indices.copy()).cuda(),
                torch.from_numpy(csr.kv_last_page_len.copy()))

        def floor():
            kv.min(), kv.max()
            h[0:B] = rows
            h[300 : 300 + B] = kv
            graph.replay()
            ev.record()

        def per_call_median(fn, n=400):
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
                if i % 50 == 0:
                    torch.cuda.synchronize()
            return statistics.median(out)

        walk_pool = table_pool(spec)
        walker = Engine(walk_pool, B, 2048, seed=B + 7, room=1300)  # lengths advancing one token a step
        for _ in range(4):
            walker.step_only()
        res_walk = {"step_only batched": per_call(walker.step_only, n=300, rounds=3),
                    "step_only per-call median": per_call_median(walker.step_only, n=300)}
        phases = {
            "flashinfer_plan": lambda: raw.plan(*args, 32, 8, 128, 16, q_data_type=spec.dtype, kv_data_type=spec.dtype),
            "floor": floor,
            "StepRows.decode": lambda: StepRows.decode(rows, kv),
            "build_plan": lambda: build_plan(sr, spec),
            "commit": lambda: pool.commit(plan),
            "table.check_step": lambda: table.check_step(plan, slots=False),
            "scheduler.schedule": lambda: sched.schedule(step),
            "graph.replay": graph.replay,
            "event.record": ev.record,
            "current_stream": lambda: torch.cuda.current_stream(0),
            "numpy kv.min()": kv.min,
        }
        res[B] = {**res_walk, **{name: per_call(fn) for name, fn in phases.items()}}
        print(B, {k: round(v, 1) for k, v in res[B].items()}, flush=True)
        del pool, walk_pool
    json.dump(res, open(f"{out_dir}/step_phases_h100.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
