"""The reference backend on token-tree verify steps (metadata/tree.py) and the accepted paths' K/V moves, on the
CPU, against dense attention over each token's own key set."""

import numpy as np
import pytest
import torch

from mstar_attn import PlanError, StepBatch, build_plan
from mstar_attn.kernels import reference
from tests.helpers import fresh_seed, make_step
from tests.kernels.test_reference import TOL
from tests.support.exact import exact_attention


def _tree_oracle(q, k_seq, v_seq, prefix, visible, scale):
    """Each tree token over the cached prefix and the new tokens `visible` marks (float64): dense attention
    with the token's own key set."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        keys = list(range(prefix)) + [prefix + i for i in np.flatnonzero(visible[j])]
        out[j] = exact_attention(q[j : j + 1], k_seq[keys], v_seq[keys], scale=scale, causal=False)[0]
    return out


@pytest.mark.parametrize("shape", ["chain", "star", "random"])
@pytest.mark.parametrize("committed", [False, True])
def test_tree_verify_equals_attention_over_each_tokens_ancestors(shape, committed):
    """A verify step of random draft trees (chains, stars, random; up to 64 tokens, prefixes from 0 to 300
    tokens), per request and token against dense attention over the prefix and the token's ancestors and
    itself; as a plan and committed to a CPU pool. Negative control: the oracle with one ancestor bit
    flipped (a token that also sees one non-ancestor, or misses one ancestor) is far off."""
    from mstar_attn import DraftTree, GraphBufferPool, PoolLimits, build_tree_plan
    from tests.support.trees import random_parents

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    sizes = [int(rng.integers(2, 65)) for _ in range(B)]
    prefix = [int(rng.choice([0, 1, int(rng.integers(2, 300))])) for _ in range(B)]
    tree = DraftTree.from_parents([random_parents(rng, n, shape) for n in sizes])
    kv = [p + n for p, n in zip(prefix, sizes)]
    spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new = make_step(seed, sizes, kv, 16, heads=(4, 2))
    plan = build_tree_plan(StepBatch.from_csr(plan.q_lens, plan.kv_lens, plan.kv_indptr, plan.kv_indices, 16), spec, tree)
    step = plan
    if committed:
        pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=512, max_num_pages=spec.num_pages,
                                                max_pages_per_request=64), device="cpu")
        step = pool.commit(plan)
        step.mark_stored()  # (make_step stored the new K/V through the plan's slots: the same slots)
    out = reference.run(step, q, cache)
    flipped = False
    for i in range(B):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        vis = tree.visible(i)
        want = _tree_oracle(q[a:b], k_seqs[i], v_seqs[i], prefix[i], vis, spec.sm_scale)
        err = ((out[a:b].double() - want).norm() / want.norm()).item()
        assert err < TOL[torch.float32], (f"seed {seed}", shape, f"request {i}", err)
        j = int(rng.integers(1, sizes[i]))  # (a token past the root: it has a non-self bit to flip)
        col = int(rng.integers(0, j))
        bad = vis.copy()
        bad[j, col] = not bad[j, col]
        wrong = _tree_oracle(q[a + j : a + j + 1], k_seqs[i], v_seqs[i], prefix[i], bad[j : j + 1], spec.sm_scale)
        off = ((out[a + j : a + j + 1].double() - wrong).norm() / wrong.norm()).item()
        flipped |= off > 100 * TOL[torch.float32]
    assert flipped, f"seed {seed}: no flipped ancestor bit changed an output"


def test_a_bucketed_tree_step_past_16_tokens_equals_attention_over_each_tokens_ancestors():
    """Trees of one size past MAX_VERIFY_Q_LEN (17..64 tokens) over cached prefixes, committed to a CPU pool whose
    max_tree_nodes holds them: the step is padded to its bucket, and every request and token equals dense
    attention over the prefix and the token's ancestors and itself."""
    from mstar_attn import DraftTree, GraphBufferPool, PoolLimits, build_tree_plan
    from tests.support.trees import random_parents

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for n in (17, int(rng.integers(18, 64)), 64):
        B = int(rng.integers(1, 4))
        prefix = [int(rng.integers(1, 300)) for _ in range(B)]
        tree = DraftTree.from_parents([random_parents(rng, n, str(rng.choice(["chain", "star", "random"])))
                                       for _ in range(B)])
        spec, plan, cache, q, k_seqs, v_seqs, _, _ = make_step(seed + n, [n] * B, [p + n for p in prefix], 16, heads=(4, 2))
        plan = build_tree_plan(StepBatch.from_csr(plan.q_lens, plan.kv_lens, plan.kv_indptr, plan.kv_indices, 16), spec, tree)
        pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=256, max_num_pages=spec.num_pages,
                                                buckets=(4,), max_pages_per_request=64, max_tree_nodes=64), device="cpu")
        step = pool.commit(plan)
        assert step.bucket == 4, (f"seed {seed}", n, B)
        step.mark_stored()  # (make_step stored the new K/V through the plan's slots: the same slots)
        out = reference.run(step, q, cache)
        for i in range(B):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            want = _tree_oracle(q[a:b], k_seqs[i], v_seqs[i], prefix[i], tree.visible(i), spec.sm_scale)
            err = ((out[a:b].double() - want).norm() / want.norm()).item()
            assert err < TOL[torch.float32], (f"seed {seed}", n, f"request {i}", err)


def test_accepted_paths_move_to_where_their_requests_continue():
    """After a tree verify step, each request keeps a random root-down path: accepted_moves + PagedKVCache.move
    put the path's K/V at prefix + 0, 1, ... (checked slot by slot, the prefix untouched), and a decode step
    over the compacted cache (kv_len prefix + kept, its query the last accepted token's) equals exact attention
    over the prefix and the path, per request."""
    from mstar_attn import DraftTree, build_tree_plan
    from mstar_attn.metadata.tree import accepted_moves
    from tests.support.trees import random_parents, random_path

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    sizes = [int(rng.integers(1, 40)) for _ in range(B)]
    prefix = [int(rng.integers(0, 200)) for _ in range(B)]
    parents = [random_parents(rng, n) for n in sizes]
    tree = DraftTree.from_parents(parents)
    spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new = make_step(seed, sizes, [p + n for p, n in zip(prefix, sizes)], 16)
    plan = build_tree_plan(StepBatch.from_csr(plan.q_lens, plan.kv_lens, plan.kv_indptr, plan.kv_indices, 16), spec, tree)
    paths = [random_path(rng, p, 0.2) for p in parents]
    moves = accepted_moves(plan, paths)
    assert moves.kept.tolist() == [len(p) for p in paths], seed
    before = [x.clone() for x in cache.flat()]
    cache.move(torch.tensor(moves.src), torch.tensor(moves.dst))
    kf, vf = cache.flat()
    for i, path in enumerate(paths):
        a = int(plan.qo_indptr[i])
        slots = plan.slot_mapping[a : a + len(path)]
        for k, j in enumerate(path):
            assert torch.equal(kf[int(slots[k])], k_new[a + j]) and torch.equal(vf[int(slots[k])], v_new[a + j]), (seed, i, k)
    moved = set(moves.dst.tolist())
    untouched = [s for s in range(kf.shape[0]) if s not in moved]
    assert torch.equal(kf[untouched], before[0][untouched]) and torch.equal(vf[untouched], before[1][untouched]), seed
    kept = [p + len(path) for p, path in zip(prefix, paths)]
    lists = [plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]][: -(-kept[i] // 16)] for i in range(B)]
    decode = build_plan(StepBatch.from_pages([1] * B, kept, lists, 16), spec)
    q1 = torch.randn(B, 4, 16, generator=torch.Generator().manual_seed(seed))
    out = reference.run(decode, q1, cache)
    for i, path in enumerate(paths):
        a = int(plan.qo_indptr[i])
        keys = torch.cat([k_seqs[i][: prefix[i]], k_new[[a + j for j in path]]])
        values = torch.cat([v_seqs[i][: prefix[i]], v_new[[a + j for j in path]]])
        want = exact_attention(q1[i : i + 1], keys, values, scale=spec.sm_scale, causal=False)
        err = ((out[i : i + 1].double() - want).norm() / want.norm()).item()
        assert err < TOL[torch.float32], (f"seed {seed}", f"request {i}", err)


@pytest.mark.parametrize("bucketed", [True, False], ids=["bucketed", "unbucketed"])
def test_a_tree_step_over_the_page_table_equals_the_same_step_over_page_lists(bucketed):
    """A tree verify step planned from StepRows (the pool's page table, its slots derived by the pool) and committed
    to a CPU pool: it stores its new K/V at the slots the StepBatch plan of the same pages lists (tree order), its
    output equals that plan's per request, and the accepted paths' moves with the table's slots (slots_of) equal
    the StepBatch plan's; bucketed (every tree one size, a verify step) and not (mixed sizes, some past 16)."""
    from mstar_attn import DraftTree, PagedKVCache, StepRows, build_tree_plan
    from mstar_attn.metadata.tree import accepted_moves
    from tests.helpers import pool_of, spec_for
    from tests.support.trees import random_parents, random_path

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=600, dtype=torch.float32)
    pool = pool_of(spec, max_batch_size=8, max_num_tokens=512, max_num_pages=600, device="cpu", buckets=(1, 2, 4, 8),
                   max_requests=16, max_pages_per_request=40)
    B = int(rng.integers(1, 7))
    sizes = [int(rng.integers(2, 17))] * B if bucketed else [int(rng.integers(1, 40)) for _ in range(B)]
    if not bucketed:  # (one tree past 16 tokens, so no draw of equal small sizes makes it a verify bucket)
        sizes[int(rng.integers(B))] = int(rng.integers(17, 40))
    kv = [int(rng.integers(1, 100)) + n for n in sizes]
    rows = rng.choice(16, B, replace=False).astype(np.int32)
    free = list(rng.permutation(600).astype(np.int32))
    lists = []
    for r, k in zip(rows, kv):
        pages = [free.pop() for _ in range(-(-k // 4) + int(rng.integers(0, 2)))]  # (sometimes a spare page)
        pool.table.assign(int(r), pages)
        lists.append(pages[: -(-k // 4)])
    parents = [random_parents(rng, n, str(rng.choice(["chain", "star", "random"]))) for n in sizes]
    tree = DraftTree.from_parents(parents)
    by_rows = build_tree_plan(StepRows(rows=rows, q_lens=sizes, kv_lens=kv), spec, tree)
    by_pages = build_tree_plan(StepBatch.from_pages(sizes, kv, lists, 4), spec, tree)
    step = pool.commit(by_rows)
    assert (step.bucket is not None) == bucketed, (seed, sizes)
    T = by_rows.num_tokens
    assert np.array_equal(step.slot_mapping[:T].numpy(), by_pages.slot_mapping), seed
    assert np.array_equal(pool.table.slots_of(by_rows), by_pages.slot_mapping), seed
    cache = PagedKVCache.allocate(spec, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    q, k, v = (torch.randn(T, h, spec.head_dim, generator=gen) for h in (spec.num_qo_heads, spec.num_kv_heads,
                                                                         spec.num_kv_heads))
    reference.write_kv(step, k, v, cache)
    out = reference.run(step, q, cache)
    want = reference.run(by_pages, q, cache)
    for i in range(B):
        a, b = int(by_pages.qo_indptr[i]), int(by_pages.qo_indptr[i + 1])
        assert torch.allclose(out[a:b], want[a:b], rtol=1e-6, atol=1e-6), (f"seed {seed}", f"request {i}")
    paths = [random_path(rng, p, 0.15) for p in parents]
    mine = accepted_moves(by_rows, paths, slots=pool.table.slots_of(by_rows))
    theirs = accepted_moves(by_pages, paths)
    assert all(np.array_equal(getattr(mine, f), getattr(theirs, f)) for f in ("src", "dst", "kept")), seed
    with pytest.raises(PlanError, match=r"a StepRows plan holds no slots; pass slots=pool.table.slots_of\(plan\)"):
        accepted_moves(by_rows, paths)
    with pytest.raises(PlanError, match=f"slots must be an int array of the step's {T} tokens"):
        accepted_moves(by_rows, paths, slots=np.zeros(T + 1, np.int64))
    with pytest.raises(PlanError, match="slots_of: the plan lists its pages"):
        pool.table.slots_of(by_pages)
