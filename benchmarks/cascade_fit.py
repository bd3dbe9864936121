"""Fit metadata/cascade.CostModel to a cascade_grid run (CPU): a coarse search over round values of
its rates. Candidates are ranked by the number of grid shapes where the model's pick is more than 3%
slower than the faster path, then by the models' log error (among the models that pick as well, the
best calibrated). The flat terms are searched first (least log error), the cascade terms over the 40
best flat fits. Prints the best candidates, after checking the search's vectorised terms against
CostModel.times on every shape, and, given a held-out run (cascade_grid --heldout), their picks
there: reported, never used to choose.
Run: python -m benchmarks.cascade_fit benchmarks/results/cascade_h100.json [benchmarks/results/cascade_heldout_h100.json]
"""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from benchmarks.cascade_grid import KVH, PS, batch_of
from mstar_attn import AttentionSpec, build_plan
from mstar_attn.metadata.cascade import CostModel, find_prefixes


def features(rows: list[dict]) -> dict[str, list]:
    """Per shape: unique and repeated flat bytes, per-group shared flops and run bytes, member
    query-row heads, suffix bytes (what CostModel.times computes from)."""
    out = {k: [] for k in ("unique", "repeats", "flops", "run", "rows", "suffix", "chunks", "waves")}
    kv_bytes = 2 * KVH * 128 * 2
    for r in rows:
        batch, pages = batch_of(r, r["B"] * 7 + r["shared"])
        p = build_plan(batch, AttentionSpec(KVH * r["gqa"], KVH, 128, PS, pages))
        c = find_prefixes(p.kv_indptr, p.kv_indices, p.q_lens, p.kv_lens, PS)
        sizes, run = np.diff(c.members_indptr), c.shared_pages.astype(np.int64) * PS
        total, rep = int(p.kv_lens.sum()), int(((sizes - 1) * run).sum())
        member_q = np.add.reduceat(p.q_lens[c.members], c.members_indptr[:-1])
        tiles = -(-(member_q * r["gqa"]) // 64) * 64
        out["unique"].append((total - rep) * kv_bytes)
        out["repeats"].append(rep * kv_bytes)
        out["flops"].append(4 * KVH * tiles * run * 128)
        out["run"].append(run * kv_bytes)
        out["rows"].append(int(member_q.sum()) * KVH * r["gqa"])
        out["suffix"].append((total - int((sizes * run).sum())) * kv_bytes)
        n, w = CostModel().partition(len(p.kv_lens), KVH, -(-int(p.kv_lens.max()) // PS), PS)
        out["chunks"].append(n)
        out["waves"].append(w)
    return out


def vector_times(f: dict, p: dict) -> tuple[np.ndarray, np.ndarray]:
    """CostModel.times over every shape at once (f: `features`, p: CostModel's fields): flat, cascade µs."""
    un, ag = np.array(f["unique"]) / p["hbm"], np.array(f["waves"]) * np.array(f["repeats"]) / p["l2"]
    ov = np.where(np.array(f["chunks"]) > 1, p["ov_split"], p["overlap"])
    flat = p["a_flat"] + np.maximum(un, ag) + ov * np.minimum(un, ag)
    shared = np.array([np.maximum(x / p["flops"], y / p["hbm_levels"]).sum() for x, y in zip(f["flops"], f["run"])])
    return flat, p["a_cascade"] + shared + np.array(f["rows"]) * p["row"] + np.array(f["suffix"]) / p["hbm_levels"]


def check(rows: list[dict], f: dict, params: dict) -> None:
    """The search's vectorised terms are CostModel.times: both agree on every shape (AssertionError otherwise)."""
    model, (flat, casc) = CostModel(**params), vector_times(f, params)
    for r, a, b in zip(rows, flat, casc):
        batch, pages = batch_of(r, r["B"] * 7 + r["shared"])
        p = build_plan(batch, AttentionSpec(KVH * r["gqa"], KVH, 128, PS, pages))
        c = find_prefixes(p.kv_indptr, p.kv_indices, p.q_lens, p.kv_lens, PS)
        assert np.allclose(model.times(c, p.q_lens, p.kv_lens, PS, KVH * r["gqa"], KVH, 128, 2 * KVH * 128 * 2), (a, b)), r


def excess(flat: np.ndarray, casc: np.ndarray, tf: np.ndarray, tc: np.ndarray, margin: float) -> tuple[int, float]:
    """From the model's (flat, casc) and the measured (tf, tc) µs per shape: the shapes where the
    pick is > 3% slower than the faster path, and the worst pick's excess over it."""
    lost = np.where(casc < flat * (1 - margin), tc, tf) / np.minimum(tf, tc) - 1
    return int((lost > 0.03).sum()), float(lost.max())


def misses(rows: list[dict], f: dict, params: dict) -> tuple[int, float]:
    """`excess` of the model with `params` on a run's rows (f: their `features`)."""
    tf, tc = np.array([r["flat_us"] for r in rows]), np.array([r["cascade_us"] for r in rows])
    return excess(*vector_times(f, params), tf, tc, params["margin"])


def main(path: str, heldout: str | None = None) -> None:
    rows = json.load(open(path))["rows"]
    f = features(rows)
    tf, tc = np.array([r["flat_us"] for r in rows]), np.array([r["cascade_us"] for r in rows])
    flats = []
    for a_f, hbm, l2, ov, ovs in itertools.product([4, 6, 8, 10, 12, 15, 18, 21], [2.6e6, 2.9e6, 3.2e6, 3.5e6],
                                                   [8e6, 1e7, 1.3e7, 1.6e7, 2e7], [0, 0.5, 1, 1.5], [0, 0.5, 1]):
        fp = dict(a_flat=a_f, hbm=hbm, l2=l2, overlap=ov, ov_split=ovs)
        flat = vector_times(f, {**fp, "a_cascade": 0, "flops": 1, "row": 0, "hbm_levels": 1})[0]
        flats.append(((np.log(flat / tf) ** 2).sum(), fp, flat))
    flats.sort(key=lambda x: x[0])
    out = []
    for lf, fp, flat in flats[:40]:
        for a_c, fl, rw, hb2 in itertools.product([15, 20, 25, 30, 35], [2.5e8, 3e8, 4e8, 5e8], [0, 2e-3, 4e-3, 5e-3, 6e-3],
                                                  [2.6e6, 2.9e6, 3.2e6]):
            params = {**fp, "a_cascade": a_c, "flops": fl, "row": rw, "hbm_levels": hb2}
            casc = vector_times(f, params)[1]
            lc = (np.log(casc / tc) ** 2).sum()
            for margin in (0.03, 0.05, 0.08):
                out.append((*excess(flat, casc, tf, tc, margin), float(lf + lc), {**params, "margin": margin}))
    out.sort(key=lambda x: (x[0], x[2]))
    check(rows, f, out[0][3])
    held = json.load(open(heldout))["rows"] if heldout else []
    fh = features(held) if held else None
    for n, worst, err, params in out[:5]:
        line = f"misses > 3%: {n}, worst +{100 * worst:.1f}%, log error {err:.2f}: {params}"
        if held:
            hn, hw = misses(held, fh, params)
            line += f"; held out: {hn} of {len(held)} misses, worst +{100 * hw:.1f}%"
        print(line)


if __name__ == "__main__":
    main(*sys.argv[1:3])
