"""Host µs of each phase of a StepRows decode step on the GPU machine, each timed alone (2,000 calls,
median of 5 rounds), beside FlashInfer's plan() and the floor the issue measured (two reductions,
two staging writes, one graph replay, one event record). Run: python -m benchmarks.step_phases OUT_DIR"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time

import attrs
import numpy as np
import torch

from benchmarks import cases
from benchmarks.host_step import Engine, table_pool
from mstar_attn import build_plan
from mstar_attn.capture.stage import StagedHead, stage_derived
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata.batch import StepRows


@attrs.frozen
class Record5:
    a: int
    b: int
    c: int
    d: int
    e: int


def read_only_copy(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out.flags.writeable = False
    return out


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
        table, sched = pool.table, pool.backend_state("flashinfer")
        step = pool.commit(plan)
        graph = next(iter(pool.device_work.graphs.values()))
        views = pool.views_of(0, step.padded_batch_size, step.padded_num_tokens, True)
        no_updates = np.zeros(0, np.int32)  # ("stage_derived": a fresh StagedHead, the whole head staged each call)
        h = pool.host_np[0]
        ev = torch.cuda.Event()
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        csr = build_plan(eng.csr(), spec)
        args = (torch.from_numpy(csr.kv_indptr.copy()), torch.from_numpy(csr.kv_indices.copy()).cuda(),
                torch.from_numpy(csr.kv_last_page_len.copy()))

        o = views.offsets  # (the floor writes what the slot's head already holds: its rows, then the lengths)

        def floor():
            kv.min(), kv.max()
            h[o.table_rows : o.table_rows + B] = rows
            h[o.kv_lens : o.kv_lens + B] = kv
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
        walker = Engine(walk_pool, B, 2048, seed=B + 7, room=1500)  # lengths advancing one token a step
        for _ in range(4):
            walker.step_only()
        res_walk = {"step_only batched": per_call(walker.step_only, n=200, rounds=3),
                    "step_only per-call median": per_call_median(walker.step_only, n=200)}
        gc.collect()
        gc.freeze()  # (what engines do after start-up: the collector no longer walks the start-up objects)
        res_walk["step_only per-call median, gc frozen"] = per_call_median(walker.step_only, n=200)
        gc.disable()
        res_walk["step_only per-call median, gc off"] = per_call_median(walker.step_only, n=200)
        gc.enable()
        gc.unfreeze()
        phases = {
            "flashinfer_plan": lambda: raw.plan(*args, 32, 8, 128, 16, q_data_type=spec.dtype, kv_data_type=spec.dtype),
            "floor": floor,
            "StepRows.decode": lambda: StepRows.decode(rows, kv),
            "build_plan": lambda: build_plan(sr, spec),
            "commit": lambda: pool.commit(plan),
            "table.check_step": lambda: table.check_step(plan, slots=False),
            "state.schedule": lambda: sched.schedule(step),
            "graph.replay": graph.replay,
            "event.record": ev.record,
            "current_stream": lambda: torch.cuda.current_stream(0),
            "numpy kv.min()": kv.min,
            "pool.validate": lambda: pool.validate(plan),
            "pool.free_slot": lambda: pool.free_slot(None),
            "stage_derived": lambda: stage_derived(h, plan, views.offsets, step.padded_batch_size, 1, no_updates, table, StagedHead()),
            "stage_derived, rows held": lambda: stage_derived(h, plan, views.offsets, step.padded_batch_size, 1, no_updates, table, pool.held[0]),
            "DeviceStep": lambda: DeviceStep(plan=plan, shape=step.shape, generation=step.generation, slots=pool.slots),
            # numpy and torch primitives the step is made of, on this host's versions
            "np: kv.copy()": kv.copy,
            "np: copy + read-only flag": lambda: read_only_copy(kv),
            "np: int(kv.max())": lambda: int(kv.max()),
            "np: range check (subtract, view, less, all)": lambda: (np.subtract(kv, rows).view(np.uint32) < kv).all(),
            "np: slice assign [B]": lambda: h.__setitem__(slice(o.kv_lens, o.kv_lens + B), kv),
            "np: tobytes [B]": rows.tobytes,
            "py: 5-field attrs record": lambda: Record5(1, 2, 3, 4, 5),
            "torch: current stream id": lambda: torch._C._cuda_getCurrentStream(0),
        }
        res[B] = {**res_walk, **{name: per_call(fn) for name, fn in phases.items()}}
        prof = cProfile.Profile()  # where a commit's time goes (cProfile inflates calls; the ranking is what counts)
        prof.enable()
        for _ in range(200):
            walker.step_only()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_callees("commit|_rows_device_work|step_only")
        open(f"{out_dir}/step_profile_b{B}.txt", "w").write(text.getvalue())
        print(B, {k: round(v, 1) for k, v in res[B].items()}, flush=True)
        del pool, walk_pool
    import platform
    res["host"] = {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
                   "cpu": platform.processor() or platform.machine()}
    json.dump(res, open(f"{out_dir}/step_phases_h100.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
