"""Draft token trees for speculative verify: several candidates per position, verified in one step.

A request's tree is its step's new tokens t_0 .. t_{n-1} with a parent each: t_0 is the root (parent
-1: the last token the target accepted, whose K/V is new this step too), every other token's parent
comes before it (so no cycles), at most MAX_TREE_NODES tokens. Token j attends to the request's cached
prefix and to its own ancestors and itself among the new tokens, never to its siblings or their
descendants; its position is prefix + depth(j). A chain (parent j - 1) is an ordinary verify step.

`DraftTree.from_parents` validates the trees (PlanError naming the request and the node) and derives
each token's depth and ancestor set as a uint64 bitset over the request's tokens (bit i: t_i is t_j or
an ancestor of it). Pure numpy, host only, like every planner.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from mstar_attn.metadata._arrays import array_field, read_only
from mstar_attn.metadata.errors import PlanError

MAX_TREE_NODES = 64  # one uint64 bitset per token

__all__ = ["MAX_TREE_NODES", "AcceptedMoves", "DraftTree", "accepted_moves"]  # (build_tree_plan: metadata/plan.py)


@attrs.frozen(kw_only=True)
class DraftTree:
    """B requests' token trees, T tokens in all (request-major, each request's tokens in its own order).

    sizes [B] int32       each request's token count (its q_len in the verify step)
    parents [T] int32     each token's parent, an index among its request's tokens (-1: the root)
    depth [T] int32       the root 0, a child one more than its parent
    masks [T] uint64      bit i: token i of the same request is this token or one of its ancestors
    Made by `from_parents` (which marks it `sealed`: a hand-made or attrs.evolve'd tree is not taken for a
    checked one); read-only arrays."""

    sizes: np.ndarray = array_field()
    parents: np.ndarray = array_field()
    depth: np.ndarray = array_field()
    masks: np.ndarray = array_field()
    sealed: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    @classmethod
    def from_parents(cls, parents: Sequence[Sequence[int]]) -> DraftTree:
        """The trees of `parents[i]` (request i's parent list, -1 for its root). PlanError for an empty tree,
        more than MAX_TREE_NODES tokens, a root that is not token 0, a second root, or a parent that is not
        an earlier token of the same request (which is every cycle too)."""
        if isinstance(parents, (str, bytes)) or not hasattr(parents, "__len__") or len(parents) == 0:
            raise PlanError("tree.parents: expected one parent list per request (at least one request)")
        sizes, flat_parents, flat_depth, flat_masks = [], [], [], []
        for r, lst in enumerate(parents):
            p = _parent_list(r, lst)
            n = p.shape[0]
            depth = np.zeros(n, np.int32)
            masks = np.zeros(n, np.uint64)
            masks[0] = 1
            for j in range(1, n):  # (a parent precedes its child: one pass in token order)
                depth[j] = depth[p[j]] + 1
                masks[j] = masks[p[j]] | np.uint64(1 << j)
            sizes.append(n)
            flat_parents.append(p)
            flat_depth.append(depth)
            flat_masks.append(masks)
        out = cls(sizes=np.array(sizes, np.int32), parents=np.concatenate(flat_parents),
                  depth=np.concatenate(flat_depth), masks=np.concatenate(flat_masks))
        read_only(out.sizes, out.parents, out.depth, out.masks)
        object.__setattr__(out, "sealed", True)
        return out

    @property
    def batch_size(self) -> int:
        return int(self.sizes.shape[0])

    def visible(self, request: int) -> np.ndarray:
        """[n, n] bool of request `request`: row j, column i True where token j attends to new token i."""
        a = int(self.sizes[:request].sum())
        n = int(self.sizes[request])
        bits = self.masks[a : a + n]
        return ((bits[:, None] >> np.arange(n, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(bool)


def _parent_list(r: int, lst) -> np.ndarray:
    """Request r's parent list as int32 [n], or PlanError naming the request and the node."""
    try:
        p = np.asarray(lst)
    except (ValueError, TypeError):
        raise PlanError(f"tree.parents[{r}]: expected a list of integers (request {r})") from None
    if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
        raise PlanError(f"tree.parents[{r}]: expected a 1-D list of integers, got shape {p.shape}, dtype {p.dtype} "
                        f"(request {r})")
    n = p.shape[0]
    if n == 0:
        raise PlanError(f"tree.parents[{r}]: an empty tree (request {r}): a tree has its root at least")
    if n > MAX_TREE_NODES:
        raise PlanError(f"tree.parents[{r}]: {n} tokens, more than the {MAX_TREE_NODES} a tree holds (request {r})")
    p = p.astype(np.int64)
    if p[0] != -1:
        raise PlanError(f"tree.parents[{r}][0] = {int(p[0])}: token 0 is the root, its parent is -1 (request {r})")
    roots = np.flatnonzero(p[1:] == -1)
    if roots.size:
        j = int(roots[0]) + 1
        raise PlanError(f"tree.parents[{r}][{j}] = -1: a second root (request {r}, node {j}); a tree has one, token 0")
    bad = np.flatnonzero((p[1:] < 0) | (p[1:] >= np.arange(1, n)))
    if bad.size:
        j = int(bad[0]) + 1
        raise PlanError(f"tree.parents[{r}][{j}] = {int(p[j])}: a parent must be an earlier token of the same request "
                        f"(0..{j - 1}; request {r}, node {j}): a parent after its child, or a cycle")
    return p.astype(np.int32)


@attrs.frozen(kw_only=True)
class AcceptedMoves:
    """Where a tree verify step's accepted tokens' K/V go (`accepted_moves`).

    src, dst [M] int64    flat cache slots: the K/V at src[m] belongs at dst[m] (moves that stay put are left out)
    kept [B] int32        each request's accepted tokens: its KV length after the step is prefix + kept
    One `PagedKVCache.move(src, dst)` per layer applies them; the slots past prefix + kept are stale."""

    src: np.ndarray = array_field()
    dst: np.ndarray = array_field()
    kept: np.ndarray = array_field()


def accepted_moves(plan, accepted: Sequence[Sequence[int]], slots: np.ndarray | None = None) -> AcceptedMoves:
    """The K/V moves after a tree verify step (`plan`: build_tree_plan's) when request i keeps the path
    accepted[i]: node indices from its root down (0 first, each next node a child of the one before). Accepted
    token k, stored at position prefix + accepted[i][k] (tree order), belongs at prefix + k, where the request
    continues. slots [T] int64: where the step stored each new token, for a plan that holds none (a StepRows
    step: `pool.table.slots_of(plan)`, read before the table changes); a StepBatch plan's own by default.
    PlanError for a path that does not start at the root or leaves the parent links (naming the request and
    the node), or a plan without a tree or slots."""
    tree = getattr(plan, "tree", None)
    if tree is None:
        raise PlanError("accepted_moves: plan is not a tree verify step (build_tree_plan)")
    if any(g.slot_mapping is not None for g in plan.groups):
        raise PlanError("accepted_moves: the spec has own-page groups (their slots are their own); plan the tree step "
                        "over one page list")
    if slots is None:
        slots = plan.slot_mapping
        if slots is None:
            raise PlanError("accepted_moves: a StepRows plan holds no slots; pass slots=pool.table.slots_of(plan)")
    elif not isinstance(slots, np.ndarray) or slots.shape != (plan.num_tokens,) or slots.dtype.kind not in "iu":
        raise PlanError(f"accepted_moves: slots must be an int array of the step's {plan.num_tokens} tokens, got "
                        f"{getattr(slots, 'shape', type(slots).__name__)}")
    if isinstance(accepted, (str, bytes)) or len(accepted) != tree.batch_size:
        raise PlanError(f"accepted: expected one path per request ({tree.batch_size})")
    src, dst, kept = [], [], []
    start = 0
    for r, path in enumerate(accepted):
        n = int(tree.sizes[r])
        parents = tree.parents[start : start + n]
        p = np.asarray(path)
        if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
            raise PlanError(f"accepted[{r}]: expected a list of node indices (request {r}), got {path!r}")
        p = [int(x) for x in p]
        if not p or p[0] != 0:
            raise PlanError(f"accepted[{r}]: a path starts at the root, node 0 (request {r}), got {path!r}")
        for k in range(1, len(p)):
            if not 0 < p[k] < n or parents[p[k]] != p[k - 1]:
                raise PlanError(f"accepted[{r}][{k}] = {p[k]}: not a child of node {p[k - 1]} in request {r}'s tree "
                                f"({n} nodes)")
        at = slots[start : start + n]
        for k, j in enumerate(p):
            if j != k:
                src.append(int(at[j]))
                dst.append(int(at[k]))
        kept.append(len(p))
        start += n
    out = AcceptedMoves(src=np.array(src, np.int64), dst=np.array(dst, np.int64), kept=np.array(kept, np.int32))
    read_only(out.src, out.dst, out.kept)
    return out
