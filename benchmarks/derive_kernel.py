"""GPU: the device work of a deferred StepRows decode commit, per step, side by side in one run:

  this kernel       the library's: the derive kernel over the pinned staging up to COPY_FIRST requests, past it
                    copy_head first and derive over the head's device copy (capture/derive.py);
  baseline kernel   the same dispatch with another version of capture/_derive_triton.py (a file named on the command
                    line, e.g. `git show REV:mstar_attn/capture/_derive_triton.py > base.py`; the arm is left out
                    without one);
  pinned reads      (B <= 16) this kernel over the pinned staging at any B;
  copy first        (B <= 16) this kernel over the head's device copy, copy_head first, at any B.

Per B = 1, 2, 4, 8, 16 (512 tokens) and 64, 256 (2,048 tokens): the part (c) loop of benchmarks/host_step.py (a 32-layer
decode graph, StepRows.decode + build_plan + commit(defer=True) per step, the commit's device work the graph's first
nodes), one pool per arm. From a CUDA-only profiler trace of 40 steps: per GPU item kind its count per step and
median µs, and the idle gap before the derive kernel. `alone_us`: wall-clock µs per launch of the arm's device work
captured 100 times in one graph on one slot (medians of 9 replays of 10), beside `floor_us`: copy_head moving 64
int32 from the same staging (one program, one read over the bus, no derivation).
Run on the GPU: python -m benchmarks.derive_kernel OUT_DIR [BASELINE.py]   (writes derive_kernel_<device>.json / .md)
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import torch

from benchmarks import cases
from benchmarks.host_step import decode_forward, per_step_us
from benchmarks.timing import cuda_spans
from mstar_attn.capture import derive
from mstar_attn.capture.layout import slot_views

SHAPES = ((1, 512), (2, 512), (4, 512), (8, 512), (16, 512), (64, 2048), (256, 2048))
FORCED = {"pinned reads": 1 << 30, "copy first": 0}  # the arms that force a read: COPY_FIRST for them


def trace(fn, n: int) -> dict:
    """Per item kind (name's first 40 characters): (count per call, median µs); and the median gap before derive."""
    ev = cuda_spans(lambda: [fn() for _ in range(n)])
    kinds: dict[str, list[float]] = {}
    for a, b, name in ev:
        kinds.setdefault(name[:40], []).append(b - a)
    gaps = [a - ev[i - 1][1] for i, (a, _, name) in enumerate(ev) if name.startswith("derive") and i > 0]
    return dict(items={k: [len(v) / n, statistics.median(v)] for k, v in kinds.items()},
                gap_before_derive_us=statistics.median(gaps[1:]))


def per_launch_us(fn, k: int = 100) -> float:
    """Wall-clock µs per call of fn (device work on the current stream) captured k times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    return statistics.median(per_step_us(lambda: [graph.replay() for _ in range(10)], 10 * k) for _ in range(9))


def arm(B: int, ctx: int, name: str, baseline) -> dict:
    """One arm at B requests of about ctx tokens: its own pool and decode graph (decode_forward), 20 steps of warm-up,
    then the trace and the per-launch timings (module docstring)."""
    default = derive.COPY_FIRST
    derive.COPY_FIRST = FORCED.get(name, default)  # (a Derivation reads it when made: the forced arms' reads)
    try:
        eng, graphs, x = decode_forward(B, ctx, room=300)
    finally:
        derive.COPY_FIRST = default
    pool, d = eng.pool, eng.pool.derivation
    if name == "baseline kernel":  # (before the first deferred step: every graph this arm captures launches these)
        d.kernel, d.copy_kernel = baseline.derive, baseline.copy_head
    for _ in range(20):
        graphs(eng.step_only(), **x)
    out = trace(lambda: graphs(eng.step_only(), **x), 40)
    items = out["items"]
    out["device_work_us"] = sum(med * cnt for k, (cnt, med) in items.items() if k.startswith(("derive", "copy_head"))) \
        + out["gap_before_derive_us"] * (B > d.copy_first)
    step = eng.step_only()
    graphs(step, **x)
    offsets = slot_views(pool.layout, pool.dev[step.slot], pool.host[step.slot], step.padded_batch_size,
                         step.padded_num_tokens).offsets
    dev, host = pool.dev[step.slot], pool.host[step.slot]
    scratch = torch.zeros(64, dtype=torch.int32, device="cuda")
    out["alone_us"] = per_launch_us(lambda: derive.derive_staged(dev, host, offsets, 1, d, None, step.slot))
    out["floor_us"] = per_launch_us(lambda: d.copy_kernel[(1,)](scratch, host, 64, BLOCK=64))
    return out


def markdown(rows: list[dict], device: str, baseline: str | None) -> str:
    lines = [f"# The derive kernel's device work per step ({device})", "",
             "`python -m benchmarks.derive_kernel OUT [BASELINE.py]`: per B, each arm's own pool under the part (c) loop "
             f"(see the module); baseline kernel: {baseline or 'none'}. device work: µs per step in a profiler trace "
             "(derive and copy_head, and the gap after the copy); alone: µs per launch, 100 launches in one graph; "
             "floor: copy_head moving 64 int32 from the staging.", "",
             "| B | context | arm | device work | alone | floor |", "|---:|---:|:---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['arm']} | {r['device_work_us']:.2f} | {r['alone_us']:.2f} | "
                     f"{r['floor_us']:.2f} |")
    return "\n".join(lines) + "\n"


def load(path: str):
    """The module at `path` (a version of capture/_derive_triton.py)."""
    spec = importlib.util.spec_from_file_location("baseline_derive_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out_dir: str, baseline_path: str | None = None) -> None:
    baseline = load(baseline_path) if baseline_path else None
    arms = ("this kernel",) + (("baseline kernel",) if baseline else ()) + tuple(FORCED)
    rows = []
    for B, ctx in SHAPES:
        for name in arms:
            if name in FORCED and B > 16:
                continue
            r = arm(B, ctx, name, baseline)
            rows.append(dict(batch=B, context=ctx, arm=name, **r))
            print(B, name, round(r["device_work_us"], 2), round(r["alone_us"], 2), round(r["floor_us"], 2), flush=True)
            torch.cuda.empty_cache()
    tag = cases.device_tag()
    with open(f"{out_dir}/derive_kernel_{tag}.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_first_default=derive.COPY_FIRST, baseline=baseline_path,
                       rows=rows), f, indent=1)
    with open(f"{out_dir}/derive_kernel_{tag}.md", "w") as f:
        f.write(markdown(rows, torch.cuda.get_device_name(), baseline_path))


if __name__ == "__main__":
    main(*sys.argv[1:3])
