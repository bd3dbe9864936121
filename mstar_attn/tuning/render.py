"""Reports of a results JSON: the Markdown table, the dispatch table as Markdown, the PNG. Pure host code."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from mstar_attn.metadata import select
from mstar_attn.tuning.grid import FLUSH_BYTES, GRID_BACKENDS, TOL
from mstar_attn.tuning.table import _ok

RESULTS_KIND = "mstar_attn.backend_grid"


def _fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def _status_word(rec) -> str:
    if rec is None:
        return "·"
    return rec.get("status", "?").split(":")[0]


def render_markdown(results: Mapping, table: Mapping | None = None) -> str:
    """The per-shape Markdown report (fastest backend per shape, each backend's median and its
    time relative to the fastest) and, when given, the derived dispatch table."""
    v = results.get("versions", {})
    m = results.get("method", {})
    c = results.get("ceilings", {})
    vtxt = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    names = [n for n in GRID_BACKENDS if any(n in r["results"] for r in results.get("shapes", []))]
    md = [f"# Attention backends per shape on {results.get('device', '?')}", "",
          f"{results.get('date', '?')}; {vtxt}.", "",
          f"One layer of one step: `write_kv` + `run`, {m.get('dtype', 'bfloat16')}. Median of "
          f"{m.get('rounds', '?')} x {m.get('reps', '?')} CUDA-event timings per backend after warm-up, backends "
          f"interleaved round by round, each round queued behind a GPU sleep (no launch gaps timed), L2 flushed "
          f"({m.get('flush_bytes', FLUSH_BYTES) >> 20} MiB written) before every repetition. Outputs checked against the "
          f"float32 reference first (norm-relative error < {m.get('tol', TOL)})."]
    if c:
        md += ["", f"Measured here: copy bandwidth {c.get('copy_TBps', float('nan')):.2f} TB/s (read + write), bf16 "
                   f"matmul {c.get('matmul_TFLOPs', float('nan')):.0f} TFLOP/s. floor = max(bytes / copy, FLOPs / matmul)."]
    md += ["", "## Fastest backend per shape (median µs; x: time relative to the fastest)", "",
           "| shape | mode | floor µs | fastest | " + " | ".join(names) + " | spread |",
           "|---|---|---:|---|" + "---:|" * len(names) + "---:|"]
    notes: dict[str, str] = {}
    for r in results.get("shapes", []):
        ok = {n: a["median_us"] for n, a in r["results"].items() if _ok(a)}
        best = min(ok, key=ok.__getitem__) if ok else None
        cells = []
        for n in names:
            a = r["results"].get(n)
            if _ok(a):
                cells.append(f"{_fmt_us(a['median_us'])} x{a['median_us'] / ok[best]:.2f}")
            else:
                cells.append(_status_word(a))
                if a is not None:
                    notes.setdefault(f"{n}: {a.get('status')}", r["name"])
        spread = max((a.get("spread", 0.0) for a in r["results"].values() if _ok(a)), default=float("nan"))
        floor = r.get("floor_us")
        md.append(f"| {r['name']} | {r['plan']['mode']} | {'' if floor is None else _fmt_us(floor)} | "
                  f"{best or '-'} | " + " | ".join(cells) + f" | {spread:.1%} |")
    md += ["", "· : the backend cannot serve this mode (prefix-free backends serve prefill only). spread: the largest "
               "round-to-round spread of the shape's medians."]
    unqueued = [f"{r['name']} / {n}" for r in results.get("shapes", []) for n, a in r["results"].items()
                if _ok(a) and a.get("queued") is False]
    if unqueued:
        md += ["", f"Rounds the host did not finish queueing before the GPU reached them (launch gaps may be in the "
                   f"time): {', '.join(unqueued)}."]
    if notes:
        md += ["", "Not measured:", ""] + [f"- {k} (first: {s})" for k, s in notes.items()]
    if table is not None:
        md += ["", render_table_markdown(table)]
    return "\n".join(md) + "\n"


def render_table_markdown(table: Mapping) -> str:
    """The dispatch table as Markdown: one row per measured bucket."""
    margin = table.get("margin")
    out = [f"## Dispatch table (non-default only where it beats flashinfer paged by > "
           f"{'?' if margin is None else f'{margin:.0%}'} and the measured spread)", ""]
    entries = table.get("entries", [])
    if not entries:
        return "\n".join(out + ["No entries: FlashInfer paged serves every step."])
    out += ["| mode class | batch | tokens/req | prefix | head_dim | gqa | page | backend | time vs flashinfer |",
            "|---|---|---|---|---:|---:|---:|---|---|"]
    for e in entries:
        lab = e.get("labels", {})
        rel = ", ".join(f"{n} {x:.2f}" for n, x in sorted(e.get("vs_flashinfer", {}).items(), key=lambda kv: kv[1]))
        out.append(f"| {e['mode']} | {lab.get('batch', e['batch'])} | {lab.get('tokens', e['tokens'])} | "
                   f"{lab.get('prefix', e['prefix'])} | {e['head_dim']} | {e['gqa']} | {e['page_size']} | "
                   f"**{e['backend']}** | {rel} |")
    return "\n".join(out)


_COLORS = {"flashinfer": "#1f77b4", "flashinfer_ragged": "#2ca02c", "flash_attn": "#d62728", "flash_attn_varlen": "#9467bd"}


def plot_results(results: Mapping, path: str | os.PathLike) -> Path:
    """A PNG of which backend wins where: per mode class, every shape's backends as bars of time
    relative to that shape's fastest (1 = fastest; the winner is named above, in its colour).
    Imports matplotlib (ImportError if it is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shapes = results.get("shapes", [])
    classes = [c for c in select.MODE_CLASSES if any(select.MODE_CLASS[r["plan"]["mode"]] == c for r in shapes)] or ["decode"]
    names = [n for n in GRID_BACKENDS if any(_ok(r["results"].get(n)) for r in shapes)]
    colors = {n: _COLORS.get(n, f"C{i}") for i, n in enumerate(names)}
    most = max(sum(select.MODE_CLASS[r["plan"]["mode"]] == c for r in shapes) for c in classes) or 1
    fig, axes = plt.subplots(len(classes), 1, figsize=(max(8.0, 0.55 * most + 3), 4.4 * len(classes)), squeeze=False)
    cap = 3.0
    for ax, cls in zip(axes[:, 0], classes):
        recs = [r for r in shapes if select.MODE_CLASS[r["plan"]["mode"]] == cls]
        oks = [{k: a["median_us"] for k, a in r["results"].items() if _ok(a)} for r in recs]
        here = [n for n in names if any(n in ok for ok in oks)]
        width = 0.8 / max(len(here), 1)
        for j, n in enumerate(here):
            xs = [i + (j - (len(here) - 1) / 2) * width for i, ok in enumerate(oks) if n in ok]
            ys = [min(ok[n] / min(ok.values()), cap) for ok in oks if n in ok]
            ax.bar(xs, ys, width, color=colors[n])
        for i, ok in enumerate(oks):
            if ok:
                best = min(ok, key=ok.__getitem__)
                ax.text(i, cap * 1.03, best, ha="center", va="bottom", fontsize=7, rotation=90, color=colors[best])
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_ylim(0, cap * 1.6)
        ax.set_yticks([0, 1, 2, 3])
        ax.set_xlim(-0.6, len(recs) - 0.4)
        ax.set_xticks(range(len(recs)))
        ax.set_xticklabels([r["name"] for r in recs], rotation=55, ha="right", fontsize=7)
        ax.set_ylabel(f"time / fastest (cap {cap:g})")
        ax.set_title(f"{cls} steps", fontsize=10, loc="left")
    fig.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper center", ncol=max(len(names), 1),
               fontsize=8, bbox_to_anchor=(0.5, 0.962))
    fig.suptitle(f"Which backend wins where: {results.get('device', '?')}, {str(results.get('date', '?'))[:10]} "
                 "(one layer, write_kv + run, medians)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_results(path: str | os.PathLike) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND:
        raise ValueError(f"{path}: not a {RESULTS_KIND} results file")
    return data


def _write_json(data, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
