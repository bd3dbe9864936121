"""Shared records for the tuning tests: hand-made results JSON (no GPU)."""

from mstar_attn import tuning

ALL = lambda name: True  # noqa: E731


def rec(name, mode, B, T, q, kv, hq=32, hkv=8, d=128, ps=16, **backends):
    """A results-JSON shape record; backends: name -> median µs, (median, spread) or a status string."""
    results = {}
    for n, x in backends.items():
        if isinstance(x, str):
            results[n] = {"status": x}
        else:
            med, spread = x if isinstance(x, tuple) else (x, 0.01)
            results[n] = {"status": "ok", "median_us": float(med), "spread": spread}
    return {"name": name, "spec": {"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "page_size": ps, "dtype": "bfloat16"},
            "plan": {"mode": mode, "batch_size": B, "num_tokens": T, "max_q_len": q, "max_kv_len": kv},
            "floor_us": 1.0, "results": results}


def results(*shapes):
    return {"kind": tuning.RESULTS_KIND, "version": 1, "device": "Test GPU", "date": "2026-11-22T00:00:00+00:00",
            "versions": {"torch": "x"}, "method": {"rounds": 3, "reps": 20}, "ceilings": {"copy_TBps": 3.0, "matmul_TFLOPs": 700.0},
            "shapes": list(shapes)}


def entries_by_shape(table):
    return {s: e for e in table["entries"] for s in e["shapes"]}
