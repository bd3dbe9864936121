"""The package's shape, read from its source: imports run down the layers and never in a circle.

Layers, bottom up (docs/architecture.md): metadata (pure planning) < cache < capture (the one
stateful place) < kernels (backends) < dense < the applications (tuning, demo, the CLI, the package
root). A module may import its own layer and the ones below, at module level or inside a function;
an import under `if TYPE_CHECKING:` is a type annotation, not a dependency. The pool finds backend
modules by name at run time (`metadata.backends.load`), which is how capture reaches kernels.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mstar_attn"
LAYERS = [
    ("mstar_attn.metadata", 0),
    ("mstar_attn.cache", 1),
    ("mstar_attn.capture", 2),
    ("mstar_attn.kernels", 3),
    ("mstar_attn.dense", 4),
    ("mstar_attn.tuning", 5),
    ("mstar_attn.warmup", 5),
    ("mstar_attn.attention", 5),
    ("mstar_attn.ops", 5),
    ("mstar_attn.piecewise", 5),
    ("mstar_attn.demo", 5),
    ("mstar_attn.__main__", 5),
    ("mstar_attn", 5),  # the package root re-exports the public API
]
MAX_LINES = 400
THIRD_PARTY_IN_METADATA = {"numpy", "attrs", "torch"}


def layer(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/architecture.md")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported mstar_attn module, at module level?, line) for every import outside TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for sub in child.orelse:
                    visit(sub, top)
                continue
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, top, child.lineno) for a in child.names if a.name.split(".")[0] == "mstar_attn")
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "mstar_attn":
                for a in child.names:  # `from pkg import submodule` depends on the submodule
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in known else child.module, top, child.lineno))
            visit(child, nested)

    visit(tree, True)
    return found


def test_imports_run_down_the_layers():
    known = modules()
    up = []
    for name, path in known.items():
        for target, _, line in imports(path, known):
            if layer(target) > layer(name):
                up.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} (layer {layer(target)} > {layer(name)})")
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def test_no_import_cycles():
    known = modules()
    graph = {name: sorted({t for t, top, _ in imports(path, known) if top and t != name}) for name, path in known.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node):
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt in graph and not state.get(nxt):
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if not state.get(node):
            dfs(node)


def test_metadata_imports_no_gpu_package():
    """The bottom layer is plain host code: numpy, attrs and torch (for dtypes) besides the stdlib."""
    import sys

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, path in modules().items():
        if layer(name) != 0:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for n in names:
                top = n.split(".")[0]
                assert top in stdlib | THIRD_PARTY_IN_METADATA | {"mstar_attn"}, f"{path.name} imports {n}"


def test_modules_stay_small():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself: a metadata module importing the pool is caught, a TYPE_CHECKING import is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mstar_attn.capture.pool import X\n"
                   "def f():\n    from mstar_attn.kernels import run\n")
    found = imports(bad, modules())
    assert [(t, top) for t, top, _ in found] == [("mstar_attn.kernels", False)]
    assert layer("mstar_attn.kernels") > layer("mstar_attn.metadata.plan")


def test_no_function_takes_more_than_8_parameters():
    """Records by name instead of long argument lists: no function or method of the package takes more
    than 8 parameters (self / cls not counted, *args and **kwargs one each)."""
    wide = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                n = len(params) - bool(a.args and a.args[0].arg in ("self", "cls"))
                if n > 8:
                    wide.append(f"{name}.{node.name} ({n})")
    assert not wide, f"functions over 8 parameters: {wide}"


def _every_import(path: Path, known: dict[str, Path]) -> set[str]:
    """Every mstar_attn module `path` names in an import: TYPE_CHECKING blocks and function bodies included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mstar_attn"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mstar_attn":
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return out


def test_no_cycle_through_objects_passed_in():
    """Coupling counts, not only imports that run: a module that annotates a type (a TYPE_CHECKING import) uses
    objects of that module passed in, and the pool uses the backend modules it loads by name (their PoolStates).
    Over all of those edges the package has no cycle (a step holds Slots, not the pool; backends and checks read a
    PoolView; a draft round is the pool's staged commit with rounds.py's pure parts), the package roots aside."""
    from mstar_attn.metadata.backends import BACKENDS

    known = modules()
    graph = {name: {t for t in _every_import(path, known) if t != name and t in known and not known[t].name == "__init__.py"}
             for name, path in known.items() if path.name != "__init__.py"}
    graph["mstar_attn.capture.pool"] |= {caps.module for caps in BACKENDS.values() if caps.module in graph}
    assert len(graph["mstar_attn.capture.pool"]) > 5  # (the edges are read: the scan is not vacuous)
    cycle = _first_cycle(graph)
    assert cycle is None, "cycle through objects passed in: " + " -> ".join(cycle or [])


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first cycle a depth-first walk of `graph` (module -> the modules it names) meets, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt in graph and not state.get(nxt) and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node) and (found := dfs(node)):
            return found
    return None


def test_the_cycle_finder_sees_a_cycle_through_an_annotation(tmp_path):
    """The rule itself: a TYPE_CHECKING import back to a module that imports this one closes a cycle."""
    known = {"mstar_attn.capture.pool": tmp_path / "pool.py", "mstar_attn.capture.step": tmp_path / "step.py"}
    known["mstar_attn.capture.pool"].write_text("from mstar_attn.capture.step import DeviceStep\n")
    known["mstar_attn.capture.step"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from mstar_attn.capture.pool import GraphBufferPool\n")
    graph = {name: _every_import(path, known) - {name} for name, path in known.items()}
    assert _first_cycle(graph) == ["mstar_attn.capture.pool", "mstar_attn.capture.step", "mstar_attn.capture.pool"]
    graph["mstar_attn.capture.step"] = set()
    assert _first_cycle(graph) is None
