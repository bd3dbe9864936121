"""Draft token trees: validation naming the request and the node, depths and ancestor bitsets against a
walk up the parents, and the tree plan's positions and refusals."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, DraftTree, LayerGroup, PlanError, StepBatch, build_plan, build_tree_plan
from mstar_attn.metadata.tree import MAX_TREE_NODES
from tests.helpers import fresh_seed
from tests.support.trees import random_parents


def _ancestors(parents: list[int], j: int) -> set[int]:
    out = set()
    while j != -1:
        out.add(j)
        j = parents[j]
    return out


@pytest.mark.parametrize("shape", ["chain", "star", "random"])
def test_depths_and_ancestor_sets_equal_a_walk_up_the_parents(shape):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    trees = [random_parents(rng, int(rng.integers(1, MAX_TREE_NODES + 1)), shape) for _ in range(5)]
    t = DraftTree.from_parents(trees)
    assert t.sizes.tolist() == [len(p) for p in trees] and t.masks.dtype == np.uint64, seed
    a = 0
    for r, p in enumerate(trees):
        vis = t.visible(r)
        for j in range(len(p)):
            want = _ancestors(p, j)
            assert set(np.flatnonzero(vis[j]).tolist()) == want, (seed, r, j)
            assert t.depth[a + j] == len(want) - 1 and t.parents[a + j] == p[j], (seed, r, j)
        a += len(p)
    assert not t.sizes.flags.writeable and not t.masks.flags.writeable


@pytest.mark.parametrize("parents, match", [
    ([[-1, 0], []], r"tree.parents\[1\]: an empty tree \(request 1\)"),
    ([[-1] + [0] * MAX_TREE_NODES], rf"tree.parents\[0\]: {MAX_TREE_NODES + 1} tokens, more than the {MAX_TREE_NODES}"),
    ([[0, -1]], r"tree.parents\[0\]\[0\] = 0: token 0 is the root"),
    ([[-1, 0, -1]], r"tree.parents\[0\]\[2\] = -1: a second root \(request 0, node 2\)"),
    ([[-1], [-1, 2, 1]], r"tree.parents\[1\]\[1\] = 2: a parent must be an earlier token .* request 1, node 1"),
    ([[-1, 0, 2]], r"tree.parents\[0\]\[2\] = 2: .* node 2\): a parent after its child, or a cycle"),
    ([[-1, -5]], r"tree.parents\[0\]\[1\] = -5"),
    ([[-1, 0.5]], r"tree.parents\[0\]: expected a 1-D list of integers"),
    ([], r"one parent list per request"),
])
def test_malformed_trees_name_the_request_and_the_node(parents, match):
    with pytest.raises(PlanError, match=match):
        DraftTree.from_parents(parents)


def test_the_tree_plan_positions_tokens_by_depth_and_refuses_what_it_cannot_serve():
    spec = AttentionSpec(4, 2, 16, 4, 64, dtype=torch.float32, backend="reference")
    tree = DraftTree.from_parents([[-1, 0, 0, 1], [-1, 0]])
    batch = StepBatch.from_pages([4, 2], [10, 3], [[1, 2, 3], [4]], 4)
    plan = build_tree_plan(batch, spec, tree)
    assert plan.positions.tolist() == [6, 7, 7, 8, 1, 2] and plan.tree is tree and plan.sealed
    with pytest.raises(PlanError, match=r"q_lens\[1\]: its new tokens are not its tree's tokens"):
        build_tree_plan(StepBatch.from_pages([4, 3], [10, 3], [[1, 2, 3], [4]], 4), spec, tree)
    with pytest.raises(PlanError, match="2 trees for a batch of 1 requests"):
        build_tree_plan(StepBatch.from_pages([4], [10], [[1, 2, 3]], 4), spec, tree)
    with pytest.raises(PlanError, match=r"backend: 'flash_attn' does not serve token trees \(backends that do: "
                       r"'flashinfer', 'reference'\)"):
        build_tree_plan(batch, AttentionSpec(4, 2, 64, 4, 64, backend="flash_attn"), tree)
    assert build_tree_plan(batch, AttentionSpec(4, 2, 64, 4, 64), tree).backend == "flashinfer"
    window = AttentionSpec(4, 2, 16, 4, 64, dtype=torch.float32, backend="reference",
                           groups=(LayerGroup(), LayerGroup("window", window=4)), layer_groups=(0, 1))
    with pytest.raises(PlanError, match=r"spec.groups\[1\]: tree verify serves full causal layer groups, not window"):
        build_tree_plan(batch, window, tree)
    other = build_tree_plan(batch, spec, DraftTree.from_parents([[-1, 0, 0, 2], [-1, 0]]))
    assert other != plan and build_tree_plan(batch, spec, DraftTree.from_parents([[-1, 0, 0, 1], [-1, 0]])) == plan
    from mstar_attn import StepRows

    rows = build_tree_plan(StepRows(rows=[5, 2], q_lens=[4, 2], kv_lens=[10, 3]), spec, tree)  # (over a page table)
    assert rows.positions.tolist() == plan.positions.tolist() and rows.rows.tolist() == [5, 2]
    assert rows.cache_positions.tolist() == [6, 7, 8, 9, 1, 2] == plan.cache_positions.tolist()  # (tree order)
    with pytest.raises(PlanError, match="tree: expected a DraftTree made by DraftTree.from_parents, got list"):
        build_tree_plan(batch, spec, [[-1, 0, 0, 1], [-1, 0]])
    import attrs

    with pytest.raises(PlanError, match="attrs.evolve'd: not checked"):
        build_tree_plan(batch, spec, attrs.evolve(tree, masks=tree.masks ^ np.uint64(2)))


def test_accepted_paths_are_checked_against_the_tree():
    from mstar_attn.metadata.tree import accepted_moves

    spec = AttentionSpec(4, 2, 16, 4, 64, dtype=torch.float32, backend="reference")
    tree = DraftTree.from_parents([[-1, 0, 0, 1], [-1, 0]])
    plan = build_tree_plan(StepBatch.from_pages([4, 2], [10, 3], [[1, 2, 3], [4]], 4), spec, tree)
    m = accepted_moves(plan, [[0, 2], [0, 1]])  # request 0 keeps node 2 (at position 8) as its position 7
    assert m.src.tolist() == [plan.slot_mapping[2]] and m.dst.tolist() == [plan.slot_mapping[1]]
    assert m.kept.tolist() == [2, 2]
    assert accepted_moves(plan, [[0, 1], [0, 1]]).src.size == 0  # (tokens already where they continue stay put)
    m = accepted_moves(plan, [[0, 1, 3], [0]])
    assert m.src.tolist() == [plan.slot_mapping[3]] and m.dst.tolist() == [plan.slot_mapping[2]]
    with pytest.raises(PlanError, match=r"accepted\[0\]\[2\] = 2: not a child of node 1 in request 0's tree"):
        accepted_moves(plan, [[0, 1, 2], [0]])
    with pytest.raises(PlanError, match=r"accepted\[1\]: a path starts at the root"):
        accepted_moves(plan, [[0], [1]])
    with pytest.raises(PlanError, match=r"accepted\[0\]\[1\] = 9: not a child"):
        accepted_moves(plan, [[0, 9], [0]])
    with pytest.raises(PlanError, match=r"one path per request \(2\)"):
        accepted_moves(plan, [[0]])
    from mstar_attn import build_plan

    with pytest.raises(PlanError, match="not a tree verify step"):
        accepted_moves(build_plan(StepBatch.from_pages([4, 2], [10, 3], [[1, 2, 3], [4]], 4), spec), [[0], [0]])


def test_a_tree_of_one_size_over_cached_prefixes_is_a_verify_step():
    """A tree step is a VERIFY step when every request's tree has one size (up to MAX_TREE_NODES) over a cached
    prefix, as a chain's verify step of up to MAX_VERIFY_Q_LEN tokens is; mixed sizes or a request without a
    prefix keep build_plan's mode, and a chain of more than MAX_VERIFY_Q_LEN tokens planned without a tree stays
    an extend step."""
    from mstar_attn import Mode
    from tests.support.trees import random_parents

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, 4, 4096, dtype=torch.float32, backend="reference")
    for n in (2, 16, 17, int(rng.integers(18, 64)), 64):
        B = int(rng.integers(1, 5))
        prefix = [int(rng.integers(1, 200)) for _ in range(B)]
        pages = [list(range(i * 80, i * 80 + -(-(p + n) // 4))) for i, p in enumerate(prefix)]
        batch = StepBatch.from_pages([n] * B, [p + n for p in prefix], pages, 4)
        tree = DraftTree.from_parents([random_parents(rng, n, "random") for _ in range(B)])
        assert build_tree_plan(batch, spec, tree).mode is Mode.VERIFY, (f"seed {seed}", n, B)
        assert build_plan(batch, spec).mode is (Mode.VERIFY if n <= 16 else Mode.EXTEND), (f"seed {seed}", n)
        if B > 1:
            mixed = StepBatch.from_pages([n] + [n - 1] * (B - 1), [p + n for p in prefix[:1]] + [p + n - 1 for p in prefix[1:]],
                                         pages, 4)
            sizes = [n] + [n - 1] * (B - 1)
            plan = build_tree_plan(mixed, spec, DraftTree.from_parents([random_parents(rng, m, "chain") for m in sizes]))
            assert plan.mode is not Mode.VERIFY, (f"seed {seed}", sizes, plan.mode)
        fresh = StepBatch.from_pages([n] * B, [n] + [p + n for p in prefix[1:]], pages, 4)  # (request 0: no prefix)
        assert build_tree_plan(fresh, spec, tree).mode is not Mode.VERIFY, (f"seed {seed}", n)
