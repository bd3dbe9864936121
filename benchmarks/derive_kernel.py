"""H100: the device work of a deferred StepRows decode commit, per step, with the derive kernel reading the pinned
staging (every program reads all R lengths over the bus) vs a copy kernel moving the head to the device first
(capture/derive.py COPY_FIRST), side by side in one run.

Per B = 1, 8 (512 tokens) and 64, 256 (2,048 tokens): the part (c) loop of benchmarks/host_step.py (a 32-layer
decode graph, StepRows.decode + build_plan + commit(defer=True) per step, the commit's device work the graph's
first nodes), one pool per arm. From a CUDA-only profiler trace of 40 steps: per GPU item kind its count per step
and median µs, and the idle gap before the derive kernel (after the copy kernel, or the step's previous item).
Run on the GPU: python -m benchmarks.derive_kernel OUT_DIR   (writes derive_kernel_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.host_step import decode_forward
from mstar_attn.capture import derive

ARMS = {"pinned reads": 1 << 30, "copy first": 0}  # derive.COPY_FIRST per arm


def trace(fn, n: int) -> dict:
    """Per item kind (name's first 40 characters): (count per call, median µs); and the median gap before derive."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)
    kinds: dict[str, list[float]] = {}
    for a, b, name in ev:
        kinds.setdefault(name[:40], []).append(b - a)
    gaps = [a - ev[i - 1][1] for i, (a, _, name) in enumerate(ev) if name.startswith("derive") and i > 0]
    return dict(items={k: [len(v) / n, statistics.median(v)] for k, v in kinds.items()},
                gap_before_derive_us=statistics.median(gaps[1:]))


def arm(B: int, ctx: int, copy_first: int) -> dict:
    derive.COPY_FIRST = copy_first  # (a pool's Derivation reads it when the pool is made)
    eng, graphs, x = decode_forward(B, ctx, room=300)
    for _ in range(20):
        graphs(eng.step_only(), **x)
    out = trace(lambda: graphs(eng.step_only(), **x), 40)
    items = out["items"]
    out["device_work_us"] = sum(med * cnt for k, (cnt, med) in items.items() if k.startswith(("derive", "copy_head"))) \
        + out["gap_before_derive_us"] * (copy_first < B)
    return out


def main(out_dir: str) -> None:
    default = derive.COPY_FIRST
    rows = []
    try:
        for B, ctx in ((1, 512), (8, 512), (64, 2048), (256, 2048)):
            for name, limit in ARMS.items():
                r = arm(B, ctx, limit)
                rows.append(dict(batch=B, context=ctx, arm=name, **r))
                print(B, name, round(r["device_work_us"], 2), {k: [round(c, 2), round(m, 2)] for k, (c, m) in r["items"].items()}, flush=True)
                torch.cuda.empty_cache()
    finally:
        derive.COPY_FIRST = default
    json.dump(dict(device=torch.cuda.get_device_name(), copy_first_default=default, rows=rows),
              open(f"{out_dir}/derive_kernel_h100.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
