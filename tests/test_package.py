"""The package root: one import path for what an engine calls, and one version."""

import tomllib
from pathlib import Path

import mstar_attn

ENGINE_API = ("AttentionSpec", "LayerGroup", "PagedKVCache", "StepBatch", "StepRows", "build_plan", "GraphBufferPool",
              "DecodeGraphs", "RoundGraphs", "DeviceStep", "write_kv", "run", "build_round", "DraftRound", "PlanError")


def test_the_root_exports_what_an_engine_calls():
    for name in ENGINE_API:
        assert name in mstar_attn.__all__ and getattr(mstar_attn, name) is not None, name
    assert mstar_attn.run is mstar_attn.kernels.run and mstar_attn.write_kv is mstar_attn.kernels.write_kv


def test_the_version_has_one_source():
    """pyproject.toml reads the version from the package (a literal setuptools finds without importing it)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mstar_attn.__version__"}
    assert mstar_attn.__version__.count(".") == 2
