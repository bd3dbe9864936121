"""Per-shape GPU microbenchmark of the attention backends, and the measured dispatch table.

`python -m mstar_attn bench [--out DIR] [--quick] [--write-table] [--plot-only JSON]` (`bench_main`).

What is timed: one layer of one engine step, the KV write and the attention together
(`kernels.write_kv(step, k, v, cache)` then `kernels.run(step, q, cache, 0, k, v)`), through the
dispatching functions, for every backend whose registry entry can serve the step (its modes;
prefix-free backends only for prefill with no cached prefix), on the same batch, cache and
inputs, side by side in one process. A backend whose package is missing is recorded
"unavailable"; one that raises, "error"; one whose output is off the float32 reference by more
than TOL (or not finite), "mismatch". None of those enter the dispatch table.

Method (the workplace's GPU timing method; choices and reasons):
  - Correct first: every backend's output is compared with the reference backend (float32
    arithmetic over the same bf16 cache) on fresh random inputs (never zeros) before timing.
  - Warm-up: the first call of every backend and shape (FlashInfer JIT, FA4 compile) and
    `warmup` more run before any timing; `first_call_s` records the first call.
  - Timing: CUDA events around each repetition, `rounds` rounds of `reps` repetitions per
    backend, backends interleaved round by round (order rotated), median of all repetitions.
    Each round is queued behind a GPU sleep long enough for the host to enqueue every
    repetition first, so the events time the GPU work back to back and not Python launch
    overhead; `queued` records that the host really was ahead (else the round is redone with a
    longer sleep, up to twice). The calls are eager, but a bucketed decode / verify step runs
    the same graph-mode FlashInfer wrappers a captured graph replays.
  - L2: flushed (FLUSH_BYTES written) before every repetition. Decided so because in a model
    step each attention call follows other layers' weights and activations, which evict the
    50 MB L2, so attention starts cold; without a flush the small shapes (a decode step of a
    few MB of KV) would be timed from cache, which serving never sees.
  - Noise: `spread` = (max - min) / median of a backend's per-round medians. The dispatch
    table picks a backend other than FlashInfer paged only when it beats it by more than
    max(margin, both spreads) on every measured shape of the bucket.
  - Two numbers: the device's copy bandwidth (a 1 GiB device copy, read + write) and bf16
    matmul rate (8192^3) are measured once; each shape's floor = max(bytes / bandwidth,
    FLOPs / matmul rate), with bytes = K/V read once + q read + out written + the write_kv
    traffic, FLOPs = 4 * qo_heads * head_dim * sum of causal (query, key) pairs.

Outputs in --out: backend_grid.json (everything, raw samples included, rewritten after every
shape so a cut-off run keeps what it measured), backend_grid.md, backend_table.json (the table
derived from this run), backend_grid.png when matplotlib is importable (the GPU machine may
not have it: `--plot-only backend_grid.json` renders it later anywhere). --write-table also
installs the derived table as the package default (mstar_attn/backend_table.json), which
`select_backend` reads for specs with backend="auto".
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import attrs
import numpy as np

from mstar_attn.kernels import BACKENDS
from mstar_attn.metadata import select
from mstar_attn.metadata.batch import StepBatch

RESULTS_KIND = "mstar_attn.backend_grid"
RESULTS_VERSION = 1
RESULTS_NAME = "backend_grid"
DEFAULT_OUT = "benchmarks/results"
PACKAGE_TABLE = select.TABLE_PATH  # where --write-table installs the table
NOISE_MARGIN = 0.03
TOL = 2e-2  # norm-relative error vs the float32 reference; bf16 kernels land near 4e-3
FLUSH_BYTES = 256 << 20  # > 5x the H100's 50 MB L2
GRID_BACKENDS = tuple(n for n in BACKENDS if n != "reference")  # the oracle is not a contender
_DTYPES = ("bfloat16", "float16")


# ------------------------------------------------------------------------------------------
# The grid (pure host code)


def _jitter(rng: np.random.Generator, x: int, n: int) -> np.ndarray:
    """n values in [x - x // 8, x], the first exactly x: the nominal value is the maximum."""
    out = (x - rng.integers(0, x // 8 + 1, n)).astype(np.int64)
    out[0] = x
    return out


@attrs.frozen
class Shape:
    """One grid point. kind: the Mode build_plan must give ("decode", "prefill", "verify",
    "extend", "mixed"). batch requests get q_len new tokens after `prefix` cached ones (decode:
    q_len 1, context prefix + 1). mixed: `batch` prefill chunks beside `decodes` decode requests,
    all over prefixes near `prefix`. Lengths vary by up to 1/8 below nominal (decode and verify
    prefixes, prefill / extend / mixed q_lens), as a real batch does; verify keeps one q_len."""

    kind: str
    batch: int
    q_len: int
    prefix: int
    heads: tuple[int, int] = attrs.field(default=(32, 8), converter=tuple)
    head_dim: int = 128
    page_size: int = 16
    decodes: int = 0
    dtype: str = "bfloat16"

    def __attrs_post_init__(self):
        ok = {
            "decode": self.q_len == 1 and self.prefix >= 0,
            "prefill": self.q_len >= 1 and self.prefix == 0,
            "verify": self.q_len >= 2 and self.prefix >= 1,
            "extend": self.q_len >= 2 and self.prefix >= 1 and self.batch >= 2,
            "mixed": self.q_len >= 2 and self.decodes >= 1,
        }.get(self.kind)
        if not ok or self.batch < 1 or self.dtype not in _DTYPES:
            raise ValueError(f"Shape: inconsistent {self!r}")

    @property
    def name(self) -> str:
        h = f"h{self.heads[0]}/{self.heads[1]} d{self.head_dim} p{self.page_size}"
        if self.kind == "decode":
            return f"decode B={self.batch} ctx={self.prefix + 1} {h}"
        if self.kind == "prefill":
            return f"prefill B={self.batch} q={self.q_len} {h}"
        extra = f"+{self.decodes}dec " if self.decodes else ""
        return f"{self.kind} B={self.batch} q={self.q_len} {extra}prefix={self.prefix} {h}"

    @property
    def group(self) -> tuple:
        """Shapes of one group share a KV cache and pools: heads, head_dim, page_size, dtype."""
        return (*self.heads, self.head_dim, self.page_size, self.dtype)

    def lens(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(q_lens, kv_lens) of one random batch of this shape."""
        n = self.batch
        if self.kind == "decode":
            q, prefix = np.ones(n, np.int64), _jitter(rng, self.prefix, n)
        elif self.kind == "prefill":
            q, prefix = _jitter(rng, self.q_len, n), np.zeros(n, np.int64)
        elif self.kind == "verify":
            q, prefix = np.full(n, self.q_len, np.int64), _jitter(rng, self.prefix, n)
        else:  # extend / mixed
            q, prefix = _jitter(rng, self.q_len, n), _jitter(rng, self.prefix, n)
            q[0], q[-1] = self.q_len, max(self.q_len - max(self.q_len // 8, 1), 1)  # not uniform: extend, not verify
            if self.decodes:
                q = np.concatenate([q, np.ones(self.decodes, np.int64)])
                prefix = np.concatenate([prefix, _jitter(rng, self.prefix, self.decodes)])
        return q, q + prefix

    @property
    def max_requests(self) -> int:
        return self.batch + self.decodes

    @property
    def max_tokens(self) -> int:
        return self.batch * self.q_len + self.decodes

    @property
    def max_pages_per_request(self) -> int:
        return -(-(self.prefix + self.q_len) // self.page_size)

    @property
    def max_pages(self) -> int:
        return self.max_requests * self.max_pages_per_request


def make_batch(shape: Shape, num_pages: int, seed: int = 0) -> StepBatch:
    """A random batch of `shape` over distinct random pages of 1..num_pages-1 (page 0 stays free:
    padded decode rows read it)."""
    rng = np.random.default_rng(seed)
    q, kv = shape.lens(rng)
    need = -(-kv // shape.page_size)
    indptr = np.zeros(q.shape[0] + 1, np.int64)
    np.cumsum(need, out=indptr[1:])
    if indptr[-1] > num_pages - 1:
        raise ValueError(f"make_batch: {shape.name} needs {indptr[-1]} pages, the cache has {num_pages - 1} besides page 0")
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32))[: indptr[-1]]
    return StepBatch.from_csr(q, kv, indptr, pages, shape.page_size)


DEFAULT_HEADS = ((32, 8), (16, 2))


def default_grid(heads=DEFAULT_HEADS, head_dim: int = 128) -> list[Shape]:
    """The full grid, bf16, one head_dim (default 128: one FlashInfer JIT family): per (qo, kv)
    heads pair (default 32/8, Llama-3-8B, and 16/2, Llama-3-70B at tensor-parallel 4: both GQA
    ratios use FlashInfer's tensor-core decode, so no extra JIT module; 32/32 adds FlashInfer's
    CUDA-core decode, ~25 s of JIT) decode at 512 / 4k / 16k tokens of context, prefill, verify,
    extend and mixed steps, all at page size 16; then a few shapes of the first pair at page size
    128 (FA4's TMA page loader on H100). Each shape falls in its own table bucket
    (tests/test_tuning.py checks it)."""
    shapes = []
    for h in heads:
        kw = dict(heads=h, head_dim=head_dim)
        for ctx, batches in ((512, (1, 8, 32, 128)), (4096, (1, 8, 32, 128)), (16384, (1, 8, 32))):
            shapes += [Shape("decode", b, 1, ctx - 1, **kw) for b in batches]
        shapes += [Shape("prefill", b, q, 0, **kw) for b, q in ((1, 512), (1, 4096), (8, 512), (8, 2048), (32, 128))]
        shapes += [Shape("verify", 32, 4, 2048, **kw), Shape("extend", 4, 512, 2048, **kw),
                   Shape("mixed", 4, 512, 2048, decodes=60, **kw)]
    kw = dict(heads=heads[0], head_dim=head_dim, page_size=128)
    shapes += [Shape("decode", 32, 1, 4095, **kw), Shape("prefill", 8, 2048, 0, **kw),
               Shape("verify", 32, 4, 2048, **kw), Shape("extend", 4, 512, 2048, **kw)]
    return shapes


def quick_grid(heads=DEFAULT_HEADS, head_dim: int = 128) -> list[Shape]:
    """Three small shapes of the first heads pair, for smoke tests (JIT still dominates a cold run)."""
    kw = dict(heads=heads[0], head_dim=head_dim)
    return [Shape("decode", 8, 1, 511, **kw), Shape("prefill", 2, 256, 0, **kw), Shape("verify", 8, 4, 512, **kw)]


def _groups(shapes: Iterable[Shape]) -> dict[tuple, list[Shape]]:
    out: dict[tuple, list[Shape]] = {}
    for s in shapes:
        out.setdefault(s.group, []).append(s)
    return out


def _cost(q: np.ndarray, kv: np.ndarray, hq: int, hkv: int, d: int, elem: int = 2) -> tuple[int, int]:
    """(bytes, FLOPs) of one layer's write_kv + causal attention over a step (see module doc)."""
    q, kv = q.astype(np.int64), kv.astype(np.int64)
    T = int(q.sum())
    kv_read = int(kv.sum()) * hkv * d * elem * 2
    q_out = 2 * T * hq * d * elem
    write = 2 * T * hkv * d * elem * 2  # read the new k, v and write them into the cache
    pairs = int((q * (kv - q)).sum() + (q * (q + 1) // 2).sum())
    return kv_read + q_out + write, 4 * hq * d * pairs


# ------------------------------------------------------------------------------------------
# The dispatch table from results (pure host code)


def _ok(rec) -> bool:
    return isinstance(rec, Mapping) and rec.get("status") == "ok" and (rec.get("median_us") or 0) > 0


def shape_key(rec: Mapping, bounds: Mapping | None = None) -> tuple:
    """The dispatch-table key of one shape record of a results JSON (from its plan and spec)."""
    p, s = rec["plan"], rec["spec"]
    return select.table_key(p["mode"], p["batch_size"], p["num_tokens"], p["max_q_len"], p["max_kv_len"], s["head_dim"],
                            s["num_qo_heads"] // s["num_kv_heads"], s["page_size"], bounds)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def derive_table(results: Mapping, margin: float = NOISE_MARGIN, bounds: Mapping | None = None) -> dict:
    """The dispatch table (JSON content, see `select.compile_table`) a results JSON implies.

    Shapes are grouped by table key. Per key, a backend other than FlashInfer paged is chosen
    only if it measured "ok" on every shape of the key and beat FlashInfer paged on each by more
    than max(margin, both backends' round-to-round spreads): t * (1 + m) < t_flashinfer. Among
    such backends the one with the smallest geometric-mean time relative to FlashInfer wins.
    Keys where FlashInfer paged has no "ok" time get no entry (FlashInfer by default anyway).
    Every entry records each candidate's geometric-mean time relative to FlashInfer paged.
    """
    bounds = dict(select.BOUNDS if bounds is None else bounds)
    by_key: dict[tuple, list] = {}
    for rec in results.get("shapes", []):
        if _ok(rec["results"].get(select.DEFAULT)):
            by_key.setdefault(shape_key(rec, bounds), []).append(rec)
    labels = {k: select.bucket_labels(v) for k, v in bounds.items()}
    entries = []
    for key in sorted(by_key, key=lambda k: (select.MODE_CLASSES.index(k[0]), k[1:])):
        recs = by_key[key]
        names = [n for n in GRID_BACKENDS if all(_ok(r["results"].get(n)) for r in recs)]
        rel, wins = {}, []
        for n in names:
            ratios, beats = [], True
            for r in recs:
                a, fi = r["results"][n], r["results"][select.DEFAULT]
                ratios.append(a["median_us"] / fi["median_us"])
                m = max(margin, a.get("spread", 0.0) or 0.0, fi.get("spread", 0.0) or 0.0)
                beats &= a["median_us"] * (1 + m) < fi["median_us"]
            rel[n] = _geomean(ratios)
            if beats and n != select.DEFAULT:
                wins.append(n)
        cls, b, t, p, d, g, ps = key
        entries.append({
            "mode": cls, "batch": b, "tokens": t, "prefix": p, "head_dim": d, "gqa": g, "page_size": ps,
            "backend": min(wins, key=rel.__getitem__) if wins else select.DEFAULT,
            "vs_flashinfer": {n: round(rel[n], 4) for n in names},
            "labels": {"batch": labels["batch"][b], "tokens": labels["tokens"][t], "prefix": labels["prefix"][p]},
            "shapes": [r["name"] for r in recs],
        })
    return {
        "version": select.TABLE_VERSION, "features": list(select.FEATURES), "bounds": {k: list(v) for k, v in bounds.items()},
        "default": select.DEFAULT, "margin": margin,
        "source": {"device": results.get("device"), "date": results.get("date"), "versions": results.get("versions", {}),
                   "results": f"{RESULTS_NAME}.json",
                   "rule": "fastest backend per bucket, only where it beats flashinfer paged by more than "
                           "max(margin, round-to-round spread) on every measured shape of the bucket; else flashinfer"},
        "entries": entries,
    }


def dumps_table(data: Mapping) -> str:
    """A table's JSON text: the header indented, one line per entry."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k != "entries"]
    rows = ",\n".join("  " + json.dumps(e) for e in data.get("entries", []))
    return "{\n" + ",\n".join(head + [' "entries": [' + (f"\n{rows}\n ]" if rows else "]")]) + "\n}\n"


def write_table(data: Mapping, path: str | os.PathLike) -> Path:
    """Write a table (checked by compiling it first) and drop select's cached copy of it."""
    select.compile_table(data, available=lambda name: True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps_table(data))
    os.replace(tmp, path)
    select.load_table.cache_clear()
    return path


# ------------------------------------------------------------------------------------------
# Reports (pure host code)


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


# ------------------------------------------------------------------------------------------
# The measurement (GPU)


class _Fatal(RuntimeError):
    """The CUDA context is unusable (a sticky error): stop the grid, keep what was measured."""


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _versions() -> dict:
    out = {}
    for dist in ("torch", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    import torch

    import mstar_attn

    out["torch"] = torch.__version__  # the imported one, whatever the metadata says
    out["cuda"] = torch.version.cuda
    out["mstar_attn"] = mstar_attn.__version__
    return out


def event_median_us(fn, n: int = 10) -> float:
    """Median µs of n CUDA-event-timed calls of fn after one warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def _ceilings() -> dict:
    """Copy bandwidth (1 GiB, read + write) and bf16 matmul rate (8192^3), on random data."""
    import torch

    def matmul_us():
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return event_median_us(lambda: a @ b)

    copy, mm_us = copy_TBps(), matmul_us()
    torch.cuda.empty_cache()
    return {"copy_TBps": copy, "matmul_TFLOPs": 2 * 8192**3 / (mm_us * 1e-6) / 1e12}


def copy_TBps(n: int = 10) -> float:
    """Device copy bandwidth, TB/s counting bytes read plus written: 1 GiB of random bytes."""
    import torch

    x = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (event_median_us(lambda: y.copy_(x), n) * 1e-6) / 1e12


class _Timer:
    """CUDA-event timing of repetitions queued behind a GPU sleep, L2 flushed before each."""

    def __init__(self, flush_bytes: int):
        import torch

        self.torch = torch
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
        self.can_sleep = hasattr(torch.cuda, "_sleep")

    def round(self, fn, reps: int, host_us: float) -> tuple[list[float], bool]:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        g0.record()
        if self.can_sleep:  # >= the host's enqueue time at clocks up to 2 GHz
            torch.cuda._sleep(int(reps * (host_us + 40.0) * 2000))
        g1.record()
        t0 = time.perf_counter()
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        queued = self.can_sleep and enqueue_ms < g0.elapsed_time(g1)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], queued


def host_median_us(fn, n: int, warmup: int = 3, sync_every: int = 0) -> float:
    """Median host µs of n calls of fn after `warmup` calls; sync_every > 0 lets the GPU catch up
    (outside the timed calls) every that many calls, so queued work never throttles the host."""
    for _ in range(warmup):
        fn()
    ts = []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if sync_every and i % sync_every == 0:
            import torch

            torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


@attrs.frozen
class BenchConfig:
    rounds: int = 3
    reps: int = 20
    warmup: int = 3
    commit_reps: int = 30
    flush_bytes: int = FLUSH_BYTES
    tol: float = TOL
    seed: int = 0


def _capable(name: str, mode: str, spec_kw: dict):
    """The AttentionSpec for backend `name`, or None when its registry entry can't serve the step."""
    from mstar_attn.metadata.spec import AttentionSpec, PlanError

    caps = BACKENDS[name]
    if mode not in caps.modes or (caps.prefix_free and mode != "prefill"):
        return None
    try:
        return AttentionSpec(**spec_kw, backend=name)
    except PlanError:
        return None


def run_grid(shapes: list[Shape], out_dir: Path, cfg: BenchConfig = BenchConfig(), log: Callable = print, *,
             device: str = "cuda", timer=None, ceilings: Mapping | None = None) -> dict:
    """Measure every shape on every backend that can serve it; returns (and keeps writing to
    out_dir/backend_grid.json) the results. Raises _Fatal after saving if CUDA breaks.
    device / timer / ceilings: the GPU and its measurements unless given (tests pass a CPU
    device with a host timer to run the whole pipeline without a GPU)."""
    import torch

    out_dir = Path(out_dir)
    t_start = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name()
        info = {"sm_count": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}"}
    else:
        name, info = f"{device} (no GPU: a pipeline test, not a measurement)", {}
    results = {
        "kind": RESULTS_KIND, "version": RESULTS_VERSION, "device": name, "device_info": info,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "host": {"python": sys.version.split()[0], "argv": sys.argv},
        "method": {**attrs.asdict(cfg), "timed": "kernels.write_kv + kernels.run, one layer",
                   "l2": "flushed before every repetition", "queued_behind_sleep": cuda and hasattr(torch.cuda, "_sleep")},
        "unavailable": {}, "shapes": [],
    }
    results["ceilings"] = c = dict(ceilings) if ceilings is not None else _ceilings()
    log(f"device {results['device']}: copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s; "
        f"{len(shapes)} shapes")
    timer = _Timer(cfg.flush_bytes) if timer is None else timer
    path = out_dir / f"{RESULTS_NAME}.json"
    try:
        for group in _groups(shapes).values():
            _run_group(group, results, timer, cfg, log, lambda: _write_json(results, path), device)
    finally:
        results["wall_s"] = round(time.perf_counter() - t_start, 1)
        _write_json(results, path)
    return results


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _cuda_ok(device="cuda") -> bool:
    try:
        _sync(device)
        return True
    except Exception:  # noqa: BLE001  a sticky CUDA error surfaces as a RuntimeError (or AcceleratorError)
        return False


def _run_group(group: list[Shape], results: dict, timer, cfg: BenchConfig, log, save, device: str) -> None:
    import torch

    from mstar_attn import kernels
    from mstar_attn.cache import PagedKVCache
    from mstar_attn.capture.pool import GraphBufferPool
    from mstar_attn.kernels import reference
    from mstar_attn.metadata.plan import build_plan
    from mstar_attn.metadata.spec import AttentionSpec

    hq, hkv, d, ps, dtype_name = group[0].group
    dtype = getattr(torch, dtype_name)
    num_pages = 1 + max(s.max_pages for s in group) + 8
    spec_kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=num_pages, dtype=dtype)
    pool_kw = dict(max_batch_size=max(256, max(s.max_requests for s in group)),
                   max_num_tokens=max(s.max_tokens for s in group), max_num_pages=num_pages,
                   max_pages_per_request=max(s.max_pages_per_request for s in group))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shape5 = (num_pages, ps, hkv, d)
    cache = PagedKVCache(torch.randn(shape5, device=device, dtype=dtype, generator=gen),
                         torch.randn(shape5, device=device, dtype=dtype, generator=gen))
    ref_spec = AttentionSpec(**spec_kw, backend="reference")
    pools: dict[str, object] = {}
    unavailable = results["unavailable"]

    def pool_for(name: str, spec):
        if name not in pools:
            pools[name] = GraphBufferPool(spec, device=device, **pool_kw)
        return pools[name]

    try:
        for i, shape in enumerate(group):
            seed = cfg.seed * 1000 + len(results["shapes"])
            batch = make_batch(shape, num_pages, seed)
            plan0 = build_plan(batch, ref_spec)
            mode = plan0.mode.value
            if mode != shape.kind:
                raise ValueError(f"grid: {shape.name} planned as {mode}, not {shape.kind}")
            T = plan0.num_tokens
            nbytes, flops = _cost(plan0.q_lens, plan0.kv_lens, hq, hkv, d, torch.finfo(dtype).bits // 8)
            c = results["ceilings"]
            floor_us = max(nbytes / (c["copy_TBps"] * 1e12), flops / (c["matmul_TFLOPs"] * 1e12)) * 1e6
            q = torch.randn(T, hq, d, device=device, dtype=dtype, generator=gen)
            k = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
            v = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
            reference.write_kv(plan0, k, v, cache)
            ref = reference.run(plan0, q.float(), cache)  # float32 arithmetic over the same bf16 cache
            rec = {"name": shape.name, "shape": attrs.asdict(shape), "spec": {**{k_: v_ for k_, v_ in spec_kw.items() if k_ != "dtype"},
                   "dtype": dtype_name}, "plan": {"mode": mode, "batch_size": plan0.batch_size, "num_tokens": T,
                   "max_q_len": plan0.max_q_len, "max_kv_len": plan0.max_kv_len},
                   "bytes": nbytes, "flops": flops, "floor_us": floor_us, "results": {}}
            live = {}
            for name in GRID_BACKENDS:
                spec = _capable(name, mode, spec_kw)
                if spec is None:
                    continue
                if name in unavailable:
                    rec["results"][name] = {"status": unavailable[name]}
                    continue
                try:
                    kernels.get_backend(name)
                    pool = pool_for(name, spec)
                except ImportError as e:  # the backend's package is missing: say so once, skip it everywhere
                    unavailable[name] = f"unavailable: {_short(e)}"
                    rec["results"][name] = {"status": unavailable[name]}
                    continue
                except Exception as e:  # noqa: BLE001  recorded, the grid goes on
                    rec["results"][name] = {"status": f"error: {_short(e)}"}
                    if not _cuda_ok(device):
                        raise _Fatal(f"{shape.name}, {name}: {_short(e)}") from e
                    continue
                try:
                    rec["results"][name], fn = _prepare(name, pool, spec, batch, q, k, v, cache, ref, cfg, T, device)
                    if fn is not None:
                        live[name] = fn
                except Exception as e:  # noqa: BLE001
                    rec["results"][name] = {"status": f"error: {_short(e)}"}
                    if not _cuda_ok(device):
                        raise _Fatal(f"{shape.name}, {name}: {_short(e)}") from e
            del ref
            try:
                _time_interleaved(live, rec["results"], timer, cfg)
            except Exception as e:  # noqa: BLE001
                for name in live:
                    rec["results"][name].setdefault("median_us", None)
                    rec["results"][name]["status"] = f"error: {_short(e)}"
                if not _cuda_ok(device):
                    raise _Fatal(f"{shape.name}, timing: {_short(e)}") from e
            for a in rec["results"].values():
                if _ok(a):
                    a["floor_fraction"] = round(floor_us / a["median_us"], 4)
            results["shapes"].append(rec)
            save()
            ok = {n: a["median_us"] for n, a in rec["results"].items() if _ok(a)}
            best = min(ok, key=ok.__getitem__) if ok else "-"
            log(f"[{len(results['shapes'])}] {shape.name}: " + ", ".join(
                f"{n} {_fmt_us(a['median_us'])}" if _ok(a) else f"{n} {_status_word(a)}" for n, a in rec["results"].items())
                + f"  -> {best}")
    finally:
        pools.clear()
        del cache
        torch.cuda.empty_cache()


def _prepare(name, pool, spec, batch, q, k, v, cache, ref, cfg: BenchConfig, T: int, device):
    """Commit, run once (JIT), check against the reference, time the host commit, warm up.
    Returns (record, fn or None)."""
    import torch

    from mstar_attn import kernels
    from mstar_attn.metadata.plan import build_plan

    plan = build_plan(batch, spec)
    t0 = time.perf_counter()
    step = pool.commit(plan)
    kernels.write_kv(step, k, v, cache)
    out = kernels.run(step, q, cache, 0, k, v)
    _sync(device)
    first_s = time.perf_counter() - t0
    kernel = sorted({type(x).__name__ for x in step.scheduled if x is not None})
    rec = {"first_call_s": round(first_s, 3), "kernel": kernel}
    if name.endswith("_ragged") and not any("Ragged" in x for x in kernel):
        rec["status"] = f"error: the scheduler planned {kernel} for plan.backend={name!r}, not ragged attention"
        return rec, None
    if out.shape[0] < T:
        rec["status"] = f"mismatch: run returned {out.shape[0]} rows for {T} tokens"
        return rec, None
    out = out[:T].float()
    if not torch.isfinite(out).all():
        rec["status"] = "mismatch: non-finite output"
        return rec, None
    err = ((out - ref).norm() / ref.norm()).item()
    rec["rel_err"] = err
    if not err < cfg.tol:
        rec["status"] = f"mismatch: norm-relative error {err:.2e} vs the float32 reference (tol {cfg.tol:.0e})"
        return rec, None
    rec["commit_us"] = round(host_median_us(lambda: pool.commit(plan), cfg.commit_reps), 2)
    step = pool.commit(plan)
    _sync(device)

    def fn():
        kernels.write_kv(step, k, v, cache)
        kernels.run(step, q, cache, 0, k, v)

    host = []
    for _ in range(cfg.warmup):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    rec["host_launch_us"] = round(statistics.median(host), 2)
    rec["status"] = "ok"
    return rec, fn


def _time_interleaved(live: dict, records: dict, timer: _Timer, cfg: BenchConfig) -> None:
    names = list(live)
    samples = {n: [] for n in names}
    rounds = {n: [] for n in names}
    queued = {n: [] for n in names}
    if not names:
        return
    for r in range(cfg.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:  # rotated: no backend always goes first
            host_us = records[n]["host_launch_us"]
            for attempt in range(3):
                xs, q = timer.round(live[n], cfg.reps, host_us * (2**attempt))
                if q or not timer.can_sleep:
                    break
            samples[n] += xs
            rounds[n].append(statistics.median(xs))
            queued[n].append(q)
    for n in names:
        med = statistics.median(samples[n])
        records[n].update(median_us=med, round_medians_us=[round(x, 3) for x in rounds[n]],
                          spread=(max(rounds[n]) - min(rounds[n])) / med, queued=all(queued[n]),
                          min_us=min(samples[n]), samples_us=[round(x, 2) for x in samples[n]])


# ------------------------------------------------------------------------------------------
# Entry point


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mstar-attn bench",
        description="Per-shape GPU microbenchmark of the attention backends (write_kv + run, side by side, medians), "
                    "and the dispatch table that backend='auto' uses.")
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"where results go (default: {DEFAULT_OUT}; with --plot-only: the JSON's folder)")
    p.add_argument("--quick", action="store_true", help="a 3-shape grid for smoke tests")
    p.add_argument("--write-table", action="store_true",
                   help=f"also install the derived dispatch table as the package default ({PACKAGE_TABLE.name})")
    p.add_argument("--plot-only", metavar="JSON", default=None,
                   help="no GPU: re-render the Markdown and the plot from a results JSON (with --write-table, "
                        "also install the table it implies)")
    p.add_argument("--margin", type=float, default=NOISE_MARGIN,
                   help=f"noise margin a backend must beat flashinfer paged by (default: {NOISE_MARGIN})")
    p.add_argument("--heads", type=_heads, default=DEFAULT_HEADS, metavar="QO/KV[,QO/KV...]",
                   help="query/KV head pairs of the grid (default: 32/8,16/2; each new GQA ratio costs FA4 compiles)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of the grid (default: 128)")
    return p


def _heads(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(x) for x in part.split("/")) for part in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) < 1 or p[0] % p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"expected QO/KV pairs like 32/8,16/2 (QO a multiple of KV), got {text!r}")
    return pairs


def _plot(results: Mapping, png: Path, json_path: Path) -> bool:
    try:
        plot_results(results, png)
    except ImportError:
        print(f"mstar-attn bench: matplotlib is not installed here, so no plot; render it later anywhere with "
              f"`python -m mstar_attn bench --plot-only {json_path}`", file=sys.stderr)
        return False
    print(f"wrote {png}")
    return True


def bench_main(argv: list[str]) -> int:
    """`python -m mstar_attn bench ...` (see _parser). 0: done; 1: the run broke (partial results
    kept); 2: bad arguments, no CUDA, or (--plot-only) no matplotlib."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    if args.plot_only:
        return _plot_only(args)
    import torch

    if not torch.cuda.is_available():
        print("mstar-attn bench: the per-shape microbenchmark needs a CUDA GPU, and none is visible here. "
              "(Without a GPU: --plot-only RESULTS.json re-renders a run's Markdown and plot.)", file=sys.stderr)
        return 2
    out = Path(args.out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    shapes = (quick_grid if args.quick else default_grid)(args.heads, args.head_dim)
    json_path = out / f"{RESULTS_NAME}.json"
    code = 0
    try:
        results = run_grid(shapes, out)
    except _Fatal as e:
        print(f"mstar-attn bench: CUDA failed ({e}); the shapes measured before are in {json_path}", file=sys.stderr)
        results, code = load_results(json_path), 1
    table = derive_table(results, args.margin)
    write_table(table, out / "backend_table.json")
    if args.write_table and code == 0:
        print(f"installed the dispatch table: {write_table(table, PACKAGE_TABLE)}")
    (out / f"{RESULTS_NAME}.md").write_text(render_markdown(results, table))
    _plot(results, out / f"{RESULTS_NAME}.png", json_path)
    print(render_table_markdown(table) + "\n")  # the per-shape table last: a cut-off tail still shows it
    print(render_markdown(results))
    print(f"wrote {json_path}, {out / (RESULTS_NAME + '.md')}, {out / 'backend_table.json'} in {results.get('wall_s', '?')} s")
    return code


def _plot_only(args) -> int:
    src = Path(args.plot_only)
    try:
        results = load_results(src)
    except (OSError, ValueError) as e:
        print(f"mstar-attn bench: --plot-only: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    table = derive_table(results, args.margin)
    if args.write_table:
        print(f"installed the dispatch table: {write_table(table, PACKAGE_TABLE)}")
    md_path = out / f"{src.stem}.md"
    md_path.write_text(render_markdown(results, table))
    print(f"wrote {md_path}")
    return 0 if _plot(results, out / f"{src.stem}.png", src) else 2
