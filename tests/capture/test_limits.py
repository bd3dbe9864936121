"""capture/limits.py: a pool's bounds as one PoolLimits record; the old keyword form still served, with a
DeprecationWarning; every misuse of the two forms a PlanError naming what is wrong."""

import pytest

from mstar_attn import GraphBufferPool, PlanError, PoolLimits
from tests.helpers import spec_for

LIMITS = dict(max_batch_size=8, max_num_tokens=8, max_num_pages=8)


def test_a_pool_takes_its_bounds_as_one_record():
    pool = GraphBufferPool(spec_for(), PoolLimits(**LIMITS, buckets=(1, 4), max_requests=3), device="cpu")
    assert pool.limits.max_requests == 3 and pool.buckets == (1, 4) and pool.table.max_requests == 3


def test_the_bounds_as_keywords_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="PoolLimits"):
        old = GraphBufferPool(spec_for(), **LIMITS, buckets=(2,), device="cpu")
    assert old.limits == PoolLimits(**LIMITS, buckets=(2,)) and old.buckets == (2,)


@pytest.mark.parametrize("args, kw, match", [
    ((), dict(LIMITS, scheduler_option_typo=1), "unknown arguments .'scheduler_option_typo'"),
    ((PoolLimits(**LIMITS),), dict(max_batch_size=8), "bounds given twice"),
    ((dict(LIMITS),), {}, "limits: expected a PoolLimits, got dict"),
    ((), dict(max_batch_size=8), r"missing \['max_num_tokens', 'max_num_pages'\]"),
    ((PoolLimits(**dict(LIMITS, max_num_tokens=0)),), {}, "max_num_tokens"),
])
def test_misuse_is_a_plan_error_naming_it(args, kw, match):
    with pytest.raises(PlanError, match=match):
        GraphBufferPool(spec_for(), *args, device="cpu", **kw)


def test_a_pool_without_a_device_takes_cuda_when_torch_sees_one_else_the_cpu():
    import torch

    spec = spec_for()  # (the reference backend: it runs on either)
    pool = GraphBufferPool(spec, PoolLimits(**LIMITS))
    assert pool.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("nodes, match", [(15, "max_tree_nodes: 16..64"), (65, "max_tree_nodes: 16..64"),
                                           (0, "max_tree_nodes"), ("64", "max_tree_nodes")])
def test_max_tree_nodes_is_between_the_verify_q_len_and_the_largest_tree(nodes, match):
    with pytest.raises(PlanError, match=match):
        GraphBufferPool(spec_for(), PoolLimits(**LIMITS, max_tree_nodes=nodes), device="cpu")


def test_trees_past_16_tokens_are_bucketed_up_to_max_tree_nodes():
    """A tree step of one size past MAX_VERIFY_Q_LEN is bucketed by a pool whose max_tree_nodes holds it (its slots
    hold the largest bucket x max_tree_nodes rows), unbucketed by a default one; a chain of that many tokens planned
    without a tree (an extend step) never is."""
    import numpy as np

    from mstar_attn import DraftTree, StepBatch, build_plan, build_tree_plan

    spec = spec_for(page_size=4, num_pages=512)
    limits = dict(max_batch_size=8, max_num_tokens=64, max_num_pages=512, buckets=(2, 4))
    wide = GraphBufferPool(spec, PoolLimits(**limits, max_tree_nodes=64), device="cpu")
    plain = GraphBufferPool(spec, PoolLimits(**limits), device="cpu")
    assert wide.layout.max_tokens == 4 * 64 and plain.layout.max_tokens == 64  # (the largest bucket x 64 rows)
    assert plain.max_verify_q_len == 16 and wide.max_verify_q_len == 64
    for n in (17, 40, 64):
        batch = StepBatch.from_pages([n] * 3, [n + 5] * 3, [list(range(i * 20, i * 20 + -(-(n + 5) // 4))) for i in range(3)], 4)
        tree = build_tree_plan(batch, spec, DraftTree.from_parents([[-1] + list(range(n - 1))] * 3))
        assert wide.bucket_for(tree) == 4 and plain.bucket_for(tree) is None, n
        assert wide.commit(tree).bucket == 4, n
        if 3 * n <= 64:
            assert plain.commit(tree).bucket is None, n
        else:
            with pytest.raises(PlanError, match=f"tokens {3 * n} exceed"):  # (unbucketed: within max_num_tokens only)
                plain.commit(tree)
        chain = build_plan(batch, spec)
        assert wide.bucket_for(chain) is None, n
    assert np.array_equal(tree.positions, build_plan(batch, spec).positions)  # (a chain tree: positions as the chain's)


def test_max_tree_nodes_past_16_needs_a_spec_that_verifies_trees():
    """Room no step could use is refused: a backend that does not verify token trees, or a spec tree verify does
    not serve (a window group, cascade on)."""
    from mstar_attn import AttentionSpec, LayerGroup

    limits = PoolLimits(**LIMITS, max_tree_nodes=32)
    with pytest.raises(PlanError, match="max_tree_nodes: 32, but backend 'flash_attn' does not verify token trees"):
        GraphBufferPool(AttentionSpec(4, 2, 64, 4, 64, backend="flash_attn"), limits, device="cpu")
    window = spec_for(groups=(LayerGroup(), LayerGroup("window", window=8)))
    with pytest.raises(PlanError, match=r"max_tree_nodes: 32, but this spec does not verify token trees \(spec.groups\[1\]"):
        GraphBufferPool(window, limits, device="cpu")
    assert GraphBufferPool(window, PoolLimits(**LIMITS), device="cpu").max_verify_q_len == 16  # (the default: served)
