"""kernels/base.py: every backend module that keeps per-pool state has a PoolState satisfying the written
protocol (a PoolStateBase), and the registry's rules are capabilities (data), read by name nowhere else."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from mstar_attn.kernels.base import PoolState, PoolStateBase
from mstar_attn.metadata.backends import BACKENDS

PACKAGE = Path(__file__).resolve().parents[2] / "mstar_attn"
PROTOCOL = ("check", "gather", "schedule", "schedule_round", "memory")


def _modules():
    out = {}
    for caps in BACKENDS.values():
        try:
            out[caps.module] = importlib.import_module(caps.module)
        except ImportError:  # (a GPU package this machine lacks: checked where it is installed)
            continue
    return out


def test_every_backend_pool_state_is_a_pool_state_base_with_the_protocol():
    mods = _modules()
    assert "mstar_attn.kernels.reference" in mods
    checked = 0
    for name, mod in mods.items():
        assert callable(getattr(mod, "run", None)) and callable(getattr(mod, "write_kv", None)), name
        cls = getattr(mod, "PoolState", None)
        if cls is None:
            continue
        assert issubclass(cls, PoolStateBase), name
        for method in PROTOCOL:
            assert callable(getattr(cls, method)), (name, method)
        assert isinstance(cls.lazy_host_arrays, bool), name
        checked += 1
    if not checked:
        pytest.skip("no backend with a PoolState imports here (GPU packages missing)")


def test_the_base_defaults_satisfy_the_protocol():
    class Minimal(PoolStateBase):
        def schedule(self, step):
            return ("ran", step)

    s = Minimal()
    assert isinstance(s, PoolState) and s.schedule_round([1, 2]) == [("ran", 1), ("ran", 2)]
    assert s.memory() == {} and s.gather(None) is None and s.check(None, None) is None and not s.lazy_host_arrays


def test_no_module_outside_the_registry_and_the_backends_names_a_backend_in_a_rule():
    """Backend names appear in comparisons, subscripts and dict keys only in metadata/backends.py (the
    registry), the backend modules themselves, and the applications above them (dense, tuning, demo)."""
    names = set(BACKENDS)
    allowed = ("metadata/backends.py", "kernels/", "dense.py", "tuning/", "demo/", "__main__.py")
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):  # name == "flashinfer", name in ("flashinfer", ...)
                parts = [node]
            elif isinstance(node, ast.Subscript):  # BACKENDS["flashinfer"]
                parts = [node.slice]
            elif isinstance(node, ast.Dict):  # {"flashinfer": ...}
                parts = [k for k in node.keys if k is not None]
            else:
                continue
            consts = [c.value for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant)]
            found += [(rel, node.lineno, c) for c in consts if c in names]
    assert not found, found


def test_the_pool_calls_nothing_on_a_backend_state_beyond_the_protocol():
    """Every attribute pool.py, rounds.py and derive.py read off a backend state is in the protocol (read from
    their source)."""
    members = {n for n, _ in inspect.getmembers(PoolState) if not n.startswith("_")} | set(PoolState.__annotations__)
    used = set()
    for rel in ("capture/pool.py", "capture/rounds.py", "capture/derive.py"):
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "state":
                used.add(node.attr)
    assert used and used <= members, used - members


def test_the_names_before_the_rename_still_work_with_a_deprecation(monkeypatch):
    """kernels.base.Scheduler / SchedulerBase, a backend module that has only a Scheduler, and a state whose
    device-work hook is still called expand: each works, with a DeprecationWarning naming the new name."""
    import types

    from mstar_attn.kernels import base
    from mstar_attn.metadata import backends

    with pytest.warns(DeprecationWarning, match="use PoolState"):
        assert base.Scheduler is PoolState
    with pytest.warns(DeprecationWarning, match="use PoolStateBase"):
        assert base.SchedulerBase is PoolStateBase

    class Old(PoolStateBase):
        def __init__(self, pool=None):
            self.seen = []

        def expand(self, step):
            self.seen.append(step)

    monkeypatch.setattr(backends, "load", lambda name: types.SimpleNamespace(__name__="old_backend", Scheduler=Old))
    with pytest.warns(DeprecationWarning, match="old_backend.Scheduler: name a backend's per-pool state PoolState"):
        assert backends.pool_state_class("reference") is Old
    state = Old()
    with pytest.warns(DeprecationWarning, match="Old.expand: name the hook gather"):
        state.gather("step")
    assert state.seen == ["step"]
