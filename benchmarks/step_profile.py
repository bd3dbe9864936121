"""cProfile of the StepRows decode step's host path on the GPU machine (B = 8 and 256): where the host
time of StepRows.decode + build_plan + commit goes. Run: python -m benchmarks.step_profile OUT_DIR"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks import cases
from benchmarks.host_step import Engine, table_pool


def main(out_dir: str) -> None:
    spec = cases.spec("flashinfer")
    text = io.StringIO()
    for B in (8, 256):
        pool = table_pool(spec)
        eng = Engine(pool, B, 2048, seed=B, room=1100)
        for _ in range(50):
            eng.step_only()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            eng.step_only()
        print(f"B={B}: {(time.perf_counter() - t0) * 1e6 / 500:.1f} µs per step (500 steps)", file=text)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            eng.step_only()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    open(f"{out_dir}/step_profile_h100.txt", "w").write(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
