"""tuning.table: the dispatch table a results JSON implies, and its JSON (CPU)."""

import json

import pytest
import torch

from mstar_attn import AttentionSpec, tuning
from mstar_attn.metadata import select
from mstar_attn.tuning import derive_table
from tests.tuning.records import ALL, entries_by_shape, rec, results


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
