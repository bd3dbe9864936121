"""PoolView: what backends and the commit checks read of a pool (capture/view.py)."""

import ast
from pathlib import Path

import attrs
import numpy as np
import torch

from mstar_attn.capture.view import PoolView
from tests.helpers import pool_of, random_batch, spec_for

PACKAGE = Path(__file__).resolve().parents[2] / "mstar_attn"


def _pool_reads(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every `pool.x`, `self.pool.x`, `state.pool.x` read in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "pool") or (isinstance(v, ast.Attribute) and v.attr == "pool"):
                out.append((node.lineno, node.attr))
    return out


def test_every_pool_attribute_a_backend_or_check_reads_is_in_the_view():
    """A backend's PoolState and the commit checks get the pool's PoolView: every attribute they read of it
    exists there (read from the source, so a GPU-only path that reads one the view lacks fails here, on the CPU),
    and none of them imports the pool."""
    have = set(attrs.fields_dict(PoolView)) | {n for n in dir(PoolView) if not n.startswith("_")}
    files = sorted((PACKAGE / "kernels").glob("*.py")) + [PACKAGE / "capture" / n for n in ("checks.py", "rounds.py")]
    missing = [f"{p.relative_to(PACKAGE.parent)}:{line} reads pool.{a}" for p in files for line, a in _pool_reads(p)
               if a not in have]
    assert not missing, missing
    assert sum(len(_pool_reads(p)) for p in files) > 50  # (the scan sees the reads: it is not vacuous)
    importers = [p.name for p in files if "capture.pool import" in p.read_text()]
    assert not importers, importers


def test_the_view_reads_the_pools_own_buffers_and_bounds():
    """The view shares the pool's slot buffers, tables and Sizing (no copies), and its index_buffer is the slot's
    index region of a group for a committed step's shape."""
    spec = spec_for(page_size=4, num_pages=64, dtype=torch.float32)
    pool = pool_of(spec, max_batch_size=8, max_num_tokens=64, max_num_pages=64, device="cpu", max_requests=8)
    v = pool.view
    assert v.host is pool.host and v.dev is pool.dev and v.table is pool.table and v.sizing is pool.sizing
    assert (v.num_slots, v.buckets, v.layout, v.max_num_tokens) == (pool.num_slots, pool.buckets, pool.layout,
                                                                     pool.max_num_tokens)
    from mstar_attn import build_plan

    step = pool.commit(build_plan(random_batch(np.random.default_rng(0), [1] * 3, [5, 6, 7], 4, 64), spec))
    at = pool.layout.at(step.padded_batch_size, step.padded_num_tokens).groups[0].indices
    buf = v.index_buffer(step, 0)
    assert buf.data_ptr() == pool.dev[step.slot][at:].data_ptr() and buf.numel() == pool.layout.index_capacity
