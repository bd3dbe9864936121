"""tuning.render: the Markdown report and the plot (CPU)."""

import json
import sys

import pytest

from mstar_attn import tuning
from mstar_attn.metadata import select
from mstar_attn.tuning import bench_main, derive_table, render_markdown
from tests.tuning.records import rec, results


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
