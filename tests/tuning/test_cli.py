"""tuning.cli: bench_main's arguments, exits and table installation (CPU)."""

import json
import sys

import torch

from mstar_attn import tuning
from mstar_attn.metadata import select
from mstar_attn.tuning import bench_main
from tests.tuning.records import ALL, rec, results


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
