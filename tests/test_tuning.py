"""mstar_attn.tuning on the CPU: the grid, the table derived from results, the reports, the CLI
entry point, and the whole measuring pipeline with FA4 modelled in plain torch (no timings checked)."""

import json
import sys
import time

import pytest
import torch

from mstar_attn import AttentionSpec, build_plan
from mstar_attn.kernels import flash_attn as fa
from mstar_attn.metadata import select
from mstar_attn import tuning
from mstar_attn.tuning import BenchConfig, Shape, bench_main, derive_table, make_batch, render_markdown

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


def test_derived_table_honours_the_noise_margin():
    r = results(
        rec("d-2%", "decode", 32, 32, 1, 3000, flashinfer=100, flash_attn=98),  # inside the 3% margin
        rec("d-10%", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=90),
        rec("d-noisy", "decode", 128, 128, 1, 3000, flashinfer=(100, 0.12), flash_attn=(90, 0.01)),  # spread 12% > 10%
        rec("p", "prefill", 8, 4000, 500, 500, flashinfer=100, flashinfer_ragged=95, flash_attn=90, flash_attn_varlen=80),
        rec("p-bad", "prefill", 1, 4000, 4000, 4000, flashinfer=100, flash_attn="mismatch: x", flash_attn_varlen=50,
            flashinfer_ragged="error: y"),
        rec("no-fi", "decode", 1, 1, 1, 3000, flashinfer="error: z", flash_attn=10),
        rec("e1", "verify", 32, 128, 4, 2000, flashinfer=100, flash_attn=80),  # one bucket, two shapes:
        rec("e2", "mixed", 32, 100, 40, 2040, flashinfer=100, flash_attn=101),  # FA must win on both
    )
    t = derive_table(r)
    by = entries_by_shape(t)
    assert by["d-2%"]["backend"] == "flashinfer" and by["d-2%"]["vs_flashinfer"]["flash_attn"] == pytest.approx(0.98)
    assert by["d-10%"]["backend"] == "flash_attn"
    assert by["d-noisy"]["backend"] == "flashinfer"
    assert by["p"]["backend"] == "flash_attn_varlen"  # the fastest of those beating the margin
    assert set(by["p"]["vs_flashinfer"]) == {"flashinfer", "flashinfer_ragged", "flash_attn", "flash_attn_varlen"}
    assert by["p-bad"]["backend"] == "flash_attn_varlen" and set(by["p-bad"]["vs_flashinfer"]) == {"flashinfer", "flash_attn_varlen"}
    assert "no-fi" not in by  # nothing to compare with
    assert by["e1"] is by["e2"] and by["e1"]["backend"] == "flashinfer"
    assert t["margin"] == tuning.NOISE_MARGIN and t["source"]["device"] == "Test GPU"
    assert entries_by_shape(derive_table(r, margin=0.15))["d-10%"]["backend"] == "flashinfer"
    assert entries_by_shape(derive_table(r, margin=0.0))["d-2%"]["backend"] == "flash_attn"

    # the derived table is what select_backend then follows
    compiled = select.compile_table(t, available=ALL)
    spec = AttentionSpec(32, 8, 128, 16, 1024, dtype=torch.bfloat16, backend="auto")
    assert select.select_backend(spec, "decode", 8, 8, 1, 3000, False, compiled) == "flash_attn"
    assert select.select_backend(spec, "decode", 32, 32, 1, 3000, False, compiled) == "flashinfer"
    assert select.select_backend(spec, "prefill", 8, 4000, 500, 500, True, compiled) == "flash_attn_varlen"
    assert select.select_backend(spec, "prefill", 8, 4000, 500, 500, False, compiled) == "flashinfer"


def test_table_json_round_trips(tmp_path):
    r = results(rec("d", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=90))
    path = tuning.write_table(derive_table(r), tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(derive_table(r)))
    assert sum(line.startswith('  {"mode"') for line in path.read_text().splitlines()) == len(data["entries"]) == 1
    assert select.compile_table(data, available=ALL).choices


def test_markdown_names_the_fastest_and_relative_times():
    r = results(rec("decode B=8 ctx=3000", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=80),
                rec("prefill B=1", "prefill", 1, 500, 500, 500, flashinfer=50, flash_attn="unavailable: no flash_attn",
                    flash_attn_varlen="unavailable: no flash_attn", flashinfer_ragged=55))
    md = render_markdown(r, derive_table(r))
    row = next(line for line in md.splitlines() if line.startswith("| decode B=8"))
    assert "| flash_attn |" in row and "x1.25" in row and "80.0 x1.00" in row
    row = next(line for line in md.splitlines() if line.startswith("| prefill B=1"))
    assert "| flashinfer |" in row and "unavailable" in row and "x1.10" in row
    assert "## Dispatch table" in md and "**flash_attn**" in md
    assert "flash_attn: unavailable: no flash_attn" in md
    assert "No entries" in tuning.render_table_markdown(select.empty_table_data())


def test_plot_only_renders_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(results(rec("d", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=80),
                                       rec("p", "prefill", 1, 500, 500, 500, flashinfer=50, flash_attn_varlen=40))))
    assert bench_main(["--plot-only", str(path), "--out", str(tmp_path / "out")]) == 0
    png = tmp_path / "out" / "grid.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "grid.md").exists()


def test_plot_only_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(results(rec("d", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=80))))
    assert bench_main(["--plot-only", str(path)]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert (tmp_path / "grid.md").exists() and not (tmp_path / "grid.png").exists()


def test_plot_only_write_table_installs_the_table(tmp_path, monkeypatch):
    target = tmp_path / "pkg" / "backend_table.json"
    monkeypatch.setattr(tuning.cli, "PACKAGE_TABLE", target)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(results(rec("d", "decode", 8, 8, 1, 3000, flashinfer=100, flash_attn=80))))
    bench_main(["--plot-only", str(path), "--write-table"])
    t = select.compile_table(json.loads(target.read_text()), available=ALL)
    assert list(t.choices.values()) == ["flash_attn"]


def test_bench_main_without_cuda_returns_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["--out", str(tmp_path), "--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert bench_main(["--no-such-flag"]) == 2
    assert bench_main(["--plot-only", str(tmp_path / "missing.json")]) == 2
    assert bench_main(["--help"]) == 0
    assert bench_main(["--heads", "32/5"]) == 2


def test_backend_grid_script_passes_its_folder(monkeypatch):
    from benchmarks import backend_grid

    seen = []
    monkeypatch.setattr(backend_grid, "bench_main", lambda argv: seen.append(argv) or 0)
    assert backend_grid.main(["/tmp/x", "--quick"]) == 0 and backend_grid.main([]) == 0
    assert seen == [["--out", "/tmp/x", "--quick"], ["--out", tuning.DEFAULT_OUT]]


@pytest.mark.parametrize("grid", [tuning.default_grid(), tuning.quick_grid(), tuning.default_grid(((32, 32), (64, 8)), 64)],
                         ids=["default", "quick", "other-heads"])
def test_grid_shapes_plan_as_their_kind_each_in_its_own_bucket(grid):
    keys = set()
    for group in tuning.grid._groups(grid).values():
        hq, hkv, d, ps, dtype = group[0].group
        num_pages = 1 + max(s.max_pages for s in group) + 8
        spec = AttentionSpec(hq, hkv, d, ps, num_pages, dtype=getattr(torch, dtype), backend="reference")
        for s in group:
            plan = build_plan(make_batch(s, num_pages, seed=3), spec)
            assert plan.mode.value == s.kind, s.name
            assert plan.max_q_len <= s.q_len and plan.max_kv_len <= s.prefix + s.q_len
            keys.add(select.table_key(plan.mode.value, plan.batch_size, plan.num_tokens, plan.max_q_len, plan.max_kv_len,
                                      d, hq // hkv, ps))
    assert len(keys) == len(grid)
    assert len(tuning.quick_grid()) <= 3


def test_shape_validation():
    with pytest.raises(ValueError):
        Shape("extend", 1, 8, 100)  # one request with a prefix and q_len > 1 is a verify step
    with pytest.raises(ValueError):
        Shape("decode", 4, 2, 100)


# ---------------------------------------------------------------------------------------------
# The whole measuring pipeline on the CPU: FA4 modelled in plain torch, FlashInfer absent (or
# unusable without a GPU), a host clock for the CUDA events. Checks plumbing, not speed.


def fake_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                page_table=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, num_splits=1):
    """Causal attention as FA4 computes it (bottom-right aligned), paged or over new K/V."""
    assert causal and window_size == (None, None) and not softcap and num_splits == 1
    cu = cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[-2]
    for b in range(len(cu) - 1):
        if page_table is not None:
            n = int(seqused_k[b])
            pages = page_table[b, : -(-n // k.shape[1])].long()
            kb, vb = (x[pages].flatten(0, 1)[:n] for x in (k, v))
        else:
            kb, vb = k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]], v[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]
        qb = q[cu[b] : cu[b + 1]].float()
        kb, vb = (x.float().repeat_interleave(rep, dim=1) for x in (kb, vb))
        logits = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        sq, sk = qb.shape[0], kb.shape[0]
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", logits.masked_fill(hidden, float("-inf")).softmax(-1), vb).to(q.dtype)
    return out, None


class HostTimer:
    can_sleep = False

    def round(self, fn, reps, host_us):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return ts, False


def test_the_pipeline_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(fa, "_varlen_func", lambda: fake_varlen)
    kw = dict(heads=(4, 2), head_dim=64, page_size=16)
    shapes = [Shape("decode", 4, 1, 40, **kw), Shape("prefill", 2, 24, 0, **kw), Shape("verify", 2, 3, 30, **kw),
              Shape("extend", 2, 10, 30, **kw), Shape("mixed", 2, 10, 30, decodes=3, **kw)]
    cfg = BenchConfig(rounds=2, reps=3, warmup=1, commit_reps=2, flush_bytes=1)
    logs = []
    r = tuning.run_grid(shapes, tmp_path, cfg, logs.append, device="cpu", timer=HostTimer(),
                        ceilings={"copy_TBps": 1.0, "matmul_TFLOPs": 1.0})
    assert json.loads((tmp_path / "backend_grid.json").read_text()) == json.loads(json.dumps(r))
    assert [s["name"] for s in r["shapes"]] == [s.name for s in shapes] and len(logs) == len(shapes) + 1
    for s in r["shapes"]:
        res = s["results"]
        prefill = s["plan"]["mode"] == "prefill"
        assert set(res) == ({"flashinfer", "flashinfer_ragged", "flash_attn", "flash_attn_varlen"} if prefill
                            else {"flashinfer", "flash_attn"})
        for name in ("flash_attn", "flash_attn_varlen") if prefill else ("flash_attn",):
            a = res[name]
            assert a["status"] == "ok", a
            assert a["rel_err"] < tuning.TOL and len(a["samples_us"]) == 6 and a["median_us"] > 0
            assert len(a["round_medians_us"]) == 2 and a["spread"] >= 0 and a["commit_us"] > 0
        assert res["flashinfer"]["status"].split(":")[0] in ("unavailable", "error")  # no GPU here
    md = render_markdown(r, derive_table(r))
    assert "decode B=4 ctx=41" in md
