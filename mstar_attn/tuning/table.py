"""The dispatch table a results JSON implies (`derive_table`), and writing it. Pure host code."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from mstar_attn.metadata import select
from mstar_attn.tuning.grid import GRID_BACKENDS

RESULTS_NAME = "backend_grid"
NOISE_MARGIN = 0.03


def _ok(rec) -> bool:
    return isinstance(rec, Mapping) and rec.get("status") == "ok" and (rec.get("median_us") or 0) > 0


def shape_key(rec: Mapping, bounds: Mapping | None = None) -> tuple:
    """The dispatch-table key of one shape record of a results JSON (from its plan and spec)."""
    p, s = rec["plan"], rec["spec"]
    features = select.step_features(p["mode"], p["batch_size"], p["num_tokens"], p["max_q_len"], p["max_kv_len"])
    return select.bucketed(select.BOUNDS if bounds is None else bounds, *features, s["head_dim"],
                           s["num_qo_heads"] // s["num_kv_heads"], s["page_size"])


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
