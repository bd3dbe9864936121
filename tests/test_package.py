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


def test_the_readme_code_runs_as_written():
    """Every python block of README.md, executed as it stands (on a CPU-only machine: the reference backend)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        scope: dict = {}
        exec(compile(block, "README.md", "exec"), scope)
        assert "out" not in scope or scope["out"].isfinite().all()
