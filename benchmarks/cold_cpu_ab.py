"""CPU, no GPU: the short-batch Python paths A/B under cold caches (a diagnosis aid; relative numbers, no targets).

Each case builds two pools of the reference backend on the CPU and alternates them step by step in one process,
touching 32 MB between steps (the engine's own work evicting the caches, as on a serving host). The "off" arm turns a
path off by patching its threshold to 0 (or, for StepRows, to the old 32), so both arms run the same code otherwise.
- rows_b64: a StepRows decode step of 64 requests (StepRows.decode + build_plan + commit(defer=True)); SHORT 32 vs 64
  (the threshold of _plan_rows_decode's reductions, Ranges and the steady commit).
- lists_b1 / lists_b8: a StepBatch step listing its pages (host_step's ListEngine); decode_arrays' short path off / on.
- cross_b4: a BART-shaped StepBatch decode step (page 4, a cross group naming cross-table rows, B = 4); the short paths
  of decode_arrays, cross_rows_plan and cross.check off / on. (GroupPlan.stored computed once and cross.record's skip
  are in both arms.) The cross device work is left out: on the CPU it runs eagerly, on the GPU it is a graph replay.
- calls_bB: the Python function calls and C-level calls (numpy, torch, builtins) one such StepBatch step makes (cProfile).
Run: python -m benchmarks.cold_cpu_ab   (prints medians of build_plan + commit, µs, then the call counts)
"""

import statistics
import sys
import time
import types

import numpy as np
import torch

try:
    import flashinfer  # noqa: F401
except ImportError:  # (host_step imports it; nothing here calls it)
    sys.modules["flashinfer"] = types.ModuleType("flashinfer")

from benchmarks import host_step as hs  # noqa: E402
from mstar_attn import AttentionSpec, CrossRows, LayerGroup, PoolLimits, StepBatch, build_plan  # noqa: E402
from mstar_attn.capture import cross, steady  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.metadata import _arrays, groups, plan, record  # noqa: E402
from mstar_attn.metadata.batch import StepRows, bucket_of  # noqa: E402

SPEC = AttentionSpec(32, 8, 128, 16, 1 << 16, backend="reference")
BIG = np.zeros(4 << 20, np.int64)  # 32 MB


def table_pool(B):
    return hs.table_pool(SPEC, (bucket_of(B),), "cpu")


def alternate(arms: dict, steps: int = 3000) -> dict:
    """arms: name -> (switch, step); switch() sets the arm's thresholds, step() returns the µs of one step."""
    out = {name: [] for name in arms}
    names = list(arms)
    for i in range(steps):
        name = names[i % len(names)]
        switch, step = arms[name]
        switch()
        BIG.__iadd__(1)
        us = step()
        if i >= 200:
            out[name].append(us)
    return {name: round(statistics.median(v), 1) for name, v in out.items()}


def rows_case(B: int) -> dict:
    def arm(short):
        def switch():
            _arrays.SHORT = plan.SHORT = steady.SHORT = short
        switch()
        pool = table_pool(B)
        eng = hs.Engine(pool, B, 2048, seed=B, room=1500)

        def step():
            if eng.kv[0] > eng.start[0] + 1200:
                eng.kv[:] = eng.start
            eng.kv += 1
            t = time.perf_counter()
            st = pool.commit(build_plan(StepRows.decode(eng.rows, eng.kv), SPEC), defer=True)
            us = (time.perf_counter() - t) * 1e6
            st.prepare()
            return us
        return switch, step
    saved = _arrays.SHORT
    try:
        return alternate({"SHORT 32": arm(32), f"SHORT {saved}": arm(saved)})
    finally:
        _arrays.SHORT = plan.SHORT = steady.SHORT = saved


def lists_case(B: int) -> dict:
    def arm(short):
        def switch():
            record.SHORT = short
        lean = hs.Engine(table_pool(B), B, 2048, seed=B, room=1500)
        lean.advance()
        listing = lean.lists()
        pool = hs.list_pool(SPEC, B, "cpu")

        def step():
            t = time.perf_counter()
            listing.commit_only(pool)
            us = (time.perf_counter() - t) * 1e6
            listing.advance()
            if listing.kv[0] > lean.kv[0] + 1200:
                listing.kv[:] = lean.kv
                listing.list_pages()
            return us
        return switch, step
    saved = record.SHORT
    try:
        return alternate({"off": arm(0), "on": arm(saved)})
    finally:
        record.SHORT = saved


def cross_case(B: int = 4, ps: int = 4) -> dict:
    spec = AttentionSpec(8, 8, 64, ps, 4000, groups=(LayerGroup(), LayerGroup("cross")), layer_groups=(0, 1) * 2,
                         backend="reference")

    def arm(short):
        def switch():
            record.SHORT = groups.SHORT = cross.SHORT = short
        pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=256, max_num_pages=4000, max_requests=32,
                                                max_encoder_tokens=512), device="cpu")
        rng = np.random.default_rng(0)
        kv, enc = rng.integers(5, 15, B), rng.integers(1, 48, B)
        perm = rng.permutation(4000)
        pages = [perm[i * 20 : (i + 1) * 20][: -(-int(k) // ps)] for i, k in enumerate(kv)]
        for r in range(B):
            pool.cross_table.assign(r, perm[1000 + 20 * r : 1000 + 20 * r + -(-int(enc[r]) // ps)])

        def batch(write):
            return StepBatch.from_pages([1] * B, kv, pages, ps, {1: CrossRows.of(list(range(B)), enc, [write] * B)})
        pool.commit(build_plan(batch(True), spec)).prepare()
        pool.device_work.run = lambda *a, **k: None  # (see the module doc)

        def step():
            b = batch(False)
            t = time.perf_counter()
            pool.commit(build_plan(b, spec), defer=True)
            return (time.perf_counter() - t) * 1e6
        return switch, step
    saved = record.SHORT
    try:
        return alternate({"off": arm(0), "on": arm(saved)})
    finally:
        record.SHORT = groups.SHORT = cross.SHORT = saved


def calls_case(B: int) -> dict:
    """Calls per StepBatch step (host_step's ListEngine, the short paths on) over 100 steps, from cProfile."""
    import cProfile
    import pstats

    lean = hs.Engine(table_pool(B), B, 2048, seed=B, room=1500)
    lean.advance()
    listing = lean.lists()
    pool = hs.list_pool(SPEC, B, "cpu")
    for _ in range(5):
        listing.commit_only(pool)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        listing.commit_only(pool)
    prof.disable()
    stats = pstats.Stats(prof).stats
    c_level = sum(v[1] for k, v in stats.items() if k[0].startswith("~"))
    return {"python": (sum(v[1] for v in stats.values()) - c_level) / 100, "c_level": c_level / 100}


def main() -> None:
    torch.set_num_threads(1)  # (2-core CI-like hosts: torch's CPU copies otherwise spin up threads per call)
    print("rows_b64", rows_case(64), flush=True)
    for B in (1, 8):
        print(f"lists_b{B}", lists_case(B), flush=True)
    print("cross_b4", cross_case(), flush=True)
    for B in (1, 64, 256):
        print(f"calls_b{B}", calls_case(B), flush=True)


if __name__ == "__main__":
    main()
