"""H100: where host_step part (c)'s exposed time goes on the GPU, at equal lengths.

Per B = 1, 8 (512 tokens) and 64, 256 (2,048 tokens), the part (c) loop (a 32-layer decode graph; the with-step
arm runs StepRows.decode + build_plan + commit(defer=True) before each DecodeGraphs call, walking the lengths
start + 1 .. start + n; the replay-only arm calls DecodeGraphs n times on one step committed at the walk's
middle lengths), each arm traced whole (timing.gpu_trace): span, busy and idle µs per step, and per GPU
item kind the difference with-step minus replay-only (count and µs per step).
At B = 1 and 8 also wall-clock µs per step (medians of 7 rounds of n steps, the arms in turn) of:
  replay       the DecodeGraphs call (the input copies, then the decode graph)
  plain        the decode graph's own replay() (no input copies)
  folded       the replay() of the graph a deferred commit's first use runs: its device work, then the forward
  same_lengths plan + commit(defer=True) + the DecodeGraphs call per step, every step at the middle lengths
so folded - plain is the commit's device work on the GPU, and same_lengths - (folded + replay - plain) what a
host commit per step adds beyond its device work.
Run on the GPU: python -m benchmarks.exposed_kernels OUT_DIR   (writes exposed_kernels_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from benchmarks.host_step import decode_forward, per_step_us
from benchmarks.timing import gpu_trace
from mstar_attn.capture.graphs import graph_key

N = 200


def wall(eng, graphs, x) -> dict:
    """Wall-clock µs per step of the four arms above (7 rounds, the arms in the same order each round; medians)."""
    def same():
        for _ in range(N):
            eng.kv[:] = eng.start + N // 2
            graphs(eng.commit_only(), **x)

    same(), same()  # (both slots' folded graphs captured)
    res = {k: [] for k in ("replay", "plain", "folded", "same_lengths")}
    for _ in range(7):
        eng.kv[:] = eng.start + N // 2 - 1
        still = eng.step_only()
        graphs(still, **x)  # (its deferred work runs here: the calls below replay the decode graph alone)
        folded, plain = graphs.prepared[graph_key(still)][0], graphs.graphs[graph_key(still)][0]
        res["replay"].append(per_step_us(lambda: [graphs(still, **x) for _ in range(N)], N))
        res["plain"].append(per_step_us(lambda: [plain.replay() for _ in range(N)], N))
        res["folded"].append(per_step_us(lambda: [folded.replay() for _ in range(N)], N))
        res["same_lengths"].append(per_step_us(same, N))
    med = {k: statistics.median(v) for k, v in res.items()}
    return dict(**{f"{k}_us": v for k, v in med.items()}, device_work_us=med["folded"] - med["plain"],
                host_added_us=med["same_lengths"] - (med["folded"] + med["replay"] - med["plain"]), rounds=res)


def one(B: int, ctx: int) -> dict:
    eng, graphs, x = decode_forward(B, ctx, room=N + 16)

    def walk():
        eng.kv[:] = eng.start
        for _ in range(N):
            graphs(eng.step_only(), **x)

    walk()  # (warm: each slot's device graph, the plans of these lengths)
    with_step = gpu_trace(walk, N)
    eng.kv[:] = eng.start + N // 2 - 1
    still = eng.step_only()
    graphs(still, **x)
    replay_only = gpu_trace(lambda: [graphs(still, **x) for _ in range(N)], N)
    wk, rk = with_step["kinds"], replay_only["kinds"]
    diff = {k: [wk.get(k, [0, 0.0])[i] - rk.get(k, [0, 0.0])[i] for i in (0, 1)] for k in set(wk) | set(rk)}
    row = dict(batch=B, context=ctx, steps=N, with_step=with_step, replay_only=replay_only,
               diff=dict(sorted(diff.items(), key=lambda kv: -abs(kv[1][1]))))
    if B <= 8:
        row["wall"] = wall(eng, graphs, x)
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    out = ["# Exposed time at equal lengths, on the GPU (H100)", "",
           f"`python -m benchmarks.exposed_kernels OUT` ({torch.cuda.get_device_name()}), {N} steps per arm; µs per step.",
           "", "Traced (CUDA activity only), each arm whole: the with-step arm walks the lengths, the replay-only arm "
           "replays the middle ones.", "",
           "| B | context | span with / replay | busy with / replay | idle with / replay | largest busy differences (kind: count, µs) |",
           "|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        w, p = r["with_step"], r["replay_only"]
        top = "; ".join(f"`{k.strip()}`: {c:+.2f}, {t:+.2f}" for k, (c, t) in list(r["diff"].items())[:4])
        out.append(f"| {r['batch']} | {r['context']} | {w['span_us']:.1f} / {p['span_us']:.1f} | {w['busy_us']:.1f} / "
                   f"{p['busy_us']:.1f} | {w['gpu_idle_us']:.1f} / {p['gpu_idle_us']:.1f} | {top} |")
    out += ["", "Wall clock (medians of 7 rounds, the arms in turn): the DecodeGraphs call, the decode graph's own replay, the "
            "folded graph's (the commit's device work, then the forward), and a plan + commit per step at the same "
            "lengths.", "",
            "| B | context | replay | plain | folded | same lengths | device work (folded - plain) | host commit adds |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "wall" in r:
            w = r["wall"]
            out.append(f"| {r['batch']} | {r['context']} | {w['replay_us']:.1f} | {w['plain_us']:.1f} | {w['folded_us']:.1f} | "
                       f"{w['same_lengths_us']:.1f} | {w['device_work_us']:+.1f} | {w['host_added_us']:+.1f} |")
    return "\n".join(out) + "\n"


def main(out_dir: str) -> None:
    rows = []
    for B, ctx in ((1, 512), (8, 512), (64, 2048), (256, 2048)):
        rows.append(one(B, ctx))
        r = rows[-1]
        print(B, ctx, {a: {m: round(r[a][m], 1) for m in ("span_us", "busy_us", "gpu_idle_us")} for a in ("with_step", "replay_only")},
              {k: round(v, 1) for k, v in r.get("wall", {}).items() if k != "rounds"}, flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
              open(f"{out_dir}/exposed_kernels_h100.json", "w"), indent=1)
    open(f"{out_dir}/exposed_kernels_h100.md", "w").write(markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
