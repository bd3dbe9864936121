"""tuning.grid: the shapes plan as their kind, each in its own table bucket (CPU)."""

import pytest
import torch

from mstar_attn import AttentionSpec, build_plan
from mstar_attn import tuning
from mstar_attn.metadata import select
from mstar_attn.tuning import Shape, make_batch


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
