"""The Markdown of a cascade_grid run, with the dispatcher's pick on every shape (CPU; no GPU needed).

The pick is what build_plan does with spec.cascade "auto" on the very batch the GPU timed
(benchmarks/cascade_grid.batch_of, same seed): cascade or flat. The table lists both times, the
speedup, the pick and its time over the faster path's. Run: python -m benchmarks.cascade_report
IN.json OUT.md
"""

from __future__ import annotations

import json
import sys

from benchmarks.cascade_grid import KVH, PS, batch_of
from mstar_attn import AttentionSpec, build_plan


def picks(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        batch, pages = batch_of(r, r["B"] * 7 + r["shared"])
        plan = build_plan(batch, AttentionSpec(KVH * r["gqa"], KVH, 128, PS, pages, cascade="auto"))
        cascade = plan.cascade is not None
        best = min(r["flat_us"], r["cascade_us"])
        out.append({**r, "pick": "cascade" if cascade else "flat",
                    "pick_over_best": (r["cascade_us"] if cascade else r["flat_us"]) / best - 1})
    return out


def summary(rows: list[dict]) -> str:
    """The picks' misses (> 3% slower than the faster path), worst and mean excess."""
    miss = [r for r in rows if r["pick_over_best"] > 0.03]
    return (f"{len(miss)} of {len(rows)} shapes more than 3% slower than the faster path"
            + (": " + "; ".join(f"GQA {r['gqa']} B {r['B']} F {r['families']} S {r['shared']} X {r['suffix']} "
                                f"(+{100 * r['pick_over_best']:.1f}%)" for r in miss) if miss else "")
            + f". Worst pick: +{100 * max(r['pick_over_best'] for r in rows):.1f}%; mean "
            f"+{100 * sum(r['pick_over_best'] for r in rows) / len(rows):.2f}%.")


def render(data: dict) -> str:
    rows = picks(data["rows"])
    m = data["meta"]
    sets = sorted({r["set"] for r in rows if "set" in r})
    held = [f"- set {n}: " + summary([r for r in rows if r.get("set") == n]) for n in sets]
    head = [
        "# Shared-prefix (cascade) decode vs flat paged decode, H100",
        "",
        f"{m['device']}, torch {m['torch']}, bf16, page {m['page_size']}, {m['kv_heads']} KV heads, d {m['head_dim']}; "
        "one layer's decode replayed from captured graphs through the pool (benchmarks/cascade_grid.py), L2 flushed by "
        "a 256 MiB read before each replay, median of 3 rounds x 15 replays; spread = (max - min) / median of the rounds. "
        "`flat`: FlashInfer paged decode (spec.cascade \"off\"); `cascade`: spec.cascade \"always\". F families of B / F "
        "requests share a prefix of S tokens each; every request has X tokens of its own. Outputs of the two paths agree "
        f"per request within {max(r['max_rel_diff'] for r in rows):.1e} (norm-relative, bf16).",
        "",
        "Pick: build_plan with spec.cascade \"auto\" on the same batch (metadata/cascade.CostModel, steps padded to "
        "the pool's default buckets). " + ("Held out of the fit (benchmarks/cascade_grid.heldout_shapes; each request's "
        "own tokens drawn from [X / 2, 3 X / 2]; sets 1 and 2 were measured while the model's form was found, set 3 "
        "once, after it was final):" if sets else summary(rows)),
        *held,
        "",
        ("| set " if sets else "") + "| GQA | B | F | S | X | flat µs | cascade µs | speedup | spread | pick | pick vs best "
        "| host plan+commit µs flat / cascade |",
        ("|---" if sets else "") + "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    body = [(f"| {r['set']} " if sets else "") + f"| {r['gqa']} | {r['B']} | {r['families']} | {r['shared']} | {r['suffix']} | {r['flat_us']:.1f} | "
            f"{r['cascade_us']:.1f} | {r['speedup']:.2f}x | {100 * max(r['flat_spread'], r['cascade_spread']):.1f}% | "
            f"{r['pick']} | {'+' if r['pick_over_best'] > 0 else ''}{100 * r['pick_over_best']:.1f}% | "
            f"{r['off_host_us']:.0f} / {r['always_host_us']:.0f} |" for r in rows]
    return "\n".join(head + body) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    with open(sys.argv[2], "w") as f:
        f.write(render(data))
