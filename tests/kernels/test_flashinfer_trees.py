"""FlashInfer on token-tree verify steps (kernels/_flashinfer_tree.py: the prefix and the masked tree part,
merged), eager and replayed, against the reference per request (GPU only): bucketed steps (every tree the
same size) through the graph-mode wrappers and their buffers, other steps through the eager ones; requests
with no cached prefix among them; a negative control with other trees of the same sizes."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, DraftTree, build_tree_plan
from mstar_attn.kernels import reference
from tests.helpers import (
    assert_close_per_request, fresh_seed, gpu_pool, marked, random_batch, random_cache, request_errors,
)
from tests.support.trees import random_parents

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.kernels import flashinfer as fi  # noqa: E402

QH, KVH, D, PS = 32, 8, 128, 16


def tree_step(rng, spec: AttentionSpec, sizes: list[int], prefix: list[int], shapes: list[str]):
    """A tree verify step over random distinct pages of spec's cache: the plan, its parent lists, q and the
    new K/V (bf16 on the GPU, seeded by rng)."""
    parents = [random_parents(rng, n, s) for n, s in zip(sizes, shapes)]
    batch = random_batch(rng, sizes, [p + n for p, n in zip(prefix, sizes)], PS, spec.num_pages)
    plan = build_tree_plan(batch, spec, DraftTree.from_parents(parents))
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    new = lambda h: torch.randn(plan.num_tokens, h, D, device="cuda", generator=gen).bfloat16()  # noqa: E731
    return plan, parents, new(QH), new(KVH), new(KVH)


@pytest.mark.smoke
@pytest.mark.parametrize("soft_cap, sinks", [(0.0, False), (30.0, False), (0.0, True)], ids=["plain", "soft-cap", "sinks"])
def test_tree_steps_match_the_reference_eager_and_replayed(soft_cap, sinks):
    """Steps of random trees (chains, stars, random), prefixes 0..3000 (0: the tree part alone; page-aligned
    ones: a tree that starts a page, its request's list holding pages past the prefix): bucketed ones (one size per step,
    2..16 tokens, 1..8 requests) replayed by the graph captured for their (bucket, size) and run eagerly,
    unbucketed ones (sizes 1..64 mixed) eagerly; every request against the reference on the same cache (with
    attention sinks: FlashInfer's by its log-sum-exp)."""
    from mstar_attn import LayerGroup

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000, soft_cap=soft_cap, groups=(LayerGroup(sinks=sinks),))
    cache = random_cache(spec, seed)
    s = (1.0 + 2.0 * torch.randn(QH, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))) \
        if sinks else None
    pool = gpu_pool(spec, buckets=(1, 2, 4, 8), max_pages_per_request=300)

    def attend(step, x):
        return fi.run(marked(step, cache), x["q"], cache, sinks=s)

    graphs = DecodeGraphs(pool, attend, {"q": torch.zeros(8 * 16, QH, D, device="cuda", dtype=torch.bfloat16)})
    captured = (3, 9)
    graphs.capture(q_lens=captured, trees=True)
    ran = {"replayed": 0, "eager bucketed": 0, "eager unbucketed": 0}
    for i in range(12):
        if i % 3 == 2:  # unbucketed: mixed sizes (the eager wrappers)
            B = int(rng.integers(2, 6))
            sizes = [int(rng.integers(1, 65)) for _ in range(B)]
            sizes[1] = int(rng.integers(1, 64))
            sizes[0] = sizes[1] + 1  # (never one size: at most 64 tokens)
        else:
            B, n = int(rng.integers(1, 9)), int(rng.choice(captured if i % 3 == 0 else [2, 5, 16]))
            sizes = [n] * B
        # (no prefix: unbucketed steps only, a step with such a request is not a verify step)
        prefix = [int(rng.choice([0 if i % 3 == 2 else 1, 1, PS * int(rng.integers(1, 100)), int(rng.integers(2, 3000))]))
                  for _ in range(B)]
        shapes = [str(x) for x in rng.choice(["chain", "star", "random"], B)]
        plan, _, q, k, v = tree_step(rng, spec, sizes, prefix, shapes)
        step = pool.commit(plan)
        fi.write_kv(step, k, v, cache)
        want = reference.run(plan, q.float(), cache, sinks=s)
        kind = "eager bucketed" if step.bucket is not None else "eager unbucketed"
        assert_close_per_request(fi.run(step, q, cache, sinks=s), want, plan, spec.dtype, (f"seed {seed}", i, kind, sizes))
        ran[kind] += 1
        if graphs.serves(step):
            assert_close_per_request(graphs(step, q=q), want, plan, spec.dtype, (f"seed {seed}", i, "replayed", sizes))
            ran["replayed"] += 1
    assert all(ran.values()), (f"seed {seed}", ran)


def test_fp8_tree_steps_eager_and_replayed():
    """An FP8 (e4m3) cache with per-tensor scales: tree steps bucketed (replayed and eager) and unbucketed, every
    request against the reference over the same quantized cache (value * scale in float32). Bound: both parts
    compute as over a bf16 cache (FP8 values are exact in bf16) and round their outputs twice (the kernel, then
    v_scale), the merge once more: 3u in norm (units=3)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000, kv_dtype=torch.float8_e4m3fn)
    cache = random_cache(spec, seed, k_scale=0.02, v_scale=0.015)
    pool = gpu_pool(spec, buckets=(1, 2, 4, 8), max_pages_per_request=300)
    graphs = DecodeGraphs(pool, lambda step, x: fi.run(marked(step, cache), x["q"], cache),
                          {"q": torch.zeros(8 * 16, QH, D, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(5,), trees=True)
    ran = {"replayed": 0, "unbucketed": 0}
    for i in range(4):
        B = int(rng.integers(2, 9))
        sizes = [5] * B if i % 2 == 0 else [int(rng.integers(17, 65))] + [int(rng.integers(1, 65)) for _ in range(B - 1)]
        prefix = [int(rng.choice([0 if i % 2 else 1, PS * int(rng.integers(1, 100)), int(rng.integers(1, 3000))]))
                  for _ in range(B)]  # (no prefix: unbucketed steps only, as above)
        plan, _, q, k, v = tree_step(rng, spec, sizes, prefix, [str(x) for x in rng.choice(["chain", "star", "random"], B)])
        step = pool.commit(plan)
        fi.write_kv(step, k, v, cache)
        want = reference.run(plan, q.float(), cache)
        assert_close_per_request(fi.run(step, q, cache), want, plan, spec.dtype, (f"seed {seed}", i, sizes), units=3)
        ran["unbucketed"] += step.bucket is None
        if graphs.serves(step):
            assert_close_per_request(graphs(step, q=q), want, plan, spec.dtype, (f"seed {seed}", i, "replayed"), units=3)
            ran["replayed"] += 1
    assert all(ran.values()), (f"seed {seed}", ran)


def test_a_tree_step_is_not_the_chain_or_another_tree():
    """Negative control: a step's output against the reference under other trees of the same sizes (a chain
    where the step has a star, a star where it has a chain) over one or two cached tokens: every request is far
    off (10x the bound at least), bucketed (equal sizes) and not; against its own trees it is within the bound."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000)
    cache = random_cache(spec, seed)
    pool = gpu_pool(spec, buckets=(1, 2, 4, 8), max_pages_per_request=300)
    for sizes in ([6, 6, 6], [5, 12, 40]):
        plan, parents, q, k, v = tree_step(rng, spec, sizes, [1, 1, 2], ["star", "chain", "star"])  # (short prefixes:
        # one key more or less among a few is far off)
        step = pool.commit(plan)
        assert (step.bucket is not None) == (len(set(sizes)) == 1), (seed, sizes)
        fi.write_kv(step, k, v, cache)
        out = fi.run(step, q, cache)
        assert_close_per_request(out, reference.run(plan, q.float(), cache), plan, spec.dtype, (f"seed {seed}", sizes))
        swapped = [[-1] + list(range(n - 1)) if p[1:] == [0] * (n - 1) else [-1] + [0] * (n - 1)
                   for p, n in zip(parents, sizes)]
        other = build_tree_plan(_batch_of(plan), spec, DraftTree.from_parents(swapped))
        errs = [err for err, _, _ in request_errors(out, reference.run(other, q.float(), cache), plan)]
        assert all(e > 10 * 2 * 2**-8 for e in errs), (f"seed {seed}", sizes, errs)


def _batch_of(plan):
    from mstar_attn import StepBatch

    return StepBatch.from_csr(plan.q_lens, plan.kv_lens, plan.kv_indptr, plan.kv_indices, PS)


@pytest.mark.parametrize("tree_nodes", [16, 64])
def test_tree_steps_over_the_page_table(tree_nodes):
    """StepRows tree steps (the pool's page table, max_tree_nodes 16 or 64): bucketed (one size up to it, the pool
    derives the step's arrays on the device after FlashInfer schedules: the mask is built from the backend's own
    staged lengths) and unbucketed;
    the slots the device derived are the StepBatch plan's of the same pages (tree order) and the table's
    (slots_of); every request against the reference on that StepBatch plan. (A tree step's commit is never
    deferred: FlashInfer plans it from host arrays, which makes its device work run at commit.)"""
    from mstar_attn import StepBatch, StepRows

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000)
    cache = random_cache(spec, seed)
    pool = gpu_pool(spec, buckets=(1, 2, 4, 8), max_pages_per_request=300, max_requests=64, max_tree_nodes=tree_nodes)
    free = list(rng.permutation(spec.num_pages).astype(np.int32))
    for i in range(6):
        B = int(rng.integers(1, 9))
        sizes = [int(rng.integers(2, tree_nodes + 1))] * B if i % 2 == 0 else [int(rng.integers(1, 40)) for _ in range(B)]
        if i % 2:  # (one tree past 16 tokens: a verify bucket only if every tree has its size, up to tree_nodes)
            sizes[int(rng.integers(B))] = int(rng.integers(17, 40))
        kv = [int(rng.integers(1, 2000)) + n for n in sizes]
        rows = rng.choice(64, B, replace=False).astype(np.int32)
        lists = []
        for r, k in zip(rows, kv):
            pages = [free.pop() for _ in range(-(-k // PS))]
            pool.table.assign(int(r), pages)
            lists.append(pages)
        tree = DraftTree.from_parents([random_parents(rng, n, str(rng.choice(["chain", "star", "random"])))
                                       for n in sizes])
        plan = build_tree_plan(StepRows(rows=rows, q_lens=sizes, kv_lens=kv), spec, tree)
        by_pages = build_tree_plan(StepBatch.from_pages(sizes, kv, lists, PS), spec, tree)
        step = pool.commit(plan, defer=True)
        assert (step.bucket is not None) == (len(set(sizes)) == 1 and sizes[0] <= tree_nodes), (seed, i, sizes)
        step.prepare()  # (the commit's device work, had it been deferred, before the slots are read)
        T = plan.num_tokens
        assert np.array_equal(step.slot_mapping[:T].cpu().numpy(), by_pages.slot_mapping), (seed, i)
        assert np.array_equal(pool.table.slots_of(plan), by_pages.slot_mapping), (seed, i)
        gen = torch.Generator(device="cuda").manual_seed(seed + i)
        q, k, v = (torch.randn(T, h, D, device="cuda", generator=gen).bfloat16() for h in (QH, KVH, KVH))
        fi.write_kv(step, k, v, cache)
        assert_close_per_request(fi.run(step, q, cache), reference.run(by_pages, q.float(), cache), plan, spec.dtype,
                                 (f"seed {seed}", i, sizes, "bucketed" if step.bucket is not None else "unbucketed"))
        for r in rows:  # (their pages back to the free list)
            free += [int(p) for p in pool.table.release(int(r))]


def test_a_large_bucket_of_trees_replays_without_split_kv():
    """A bucket of 256 requests x 8 KV heads (past two CTAs per SM): the tree wrapper plans with split-KV off, so
    its partial outputs never need the shared float workspace (with split-KV, FlashInfer's planner asks more than
    its 128 MiB at this bucket); captured and replayed, every request against the reference."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000)
    cache = random_cache(spec, seed)
    pool = gpu_pool(spec, buckets=(256,), max_pages_per_request=16)
    graphs = DecodeGraphs(pool, lambda step, x: fi.run(marked(step, cache), x["q"], cache),
                          {"q": torch.zeros(256 * 4, QH, D, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(4,), trees=True)
    B = int(rng.integers(200, 257))
    plan, _, q, k, v = tree_step(rng, spec, [4] * B, [int(rng.integers(1, 200)) for _ in range(B)],
                                 [str(x) for x in rng.choice(["chain", "star", "random"], B)])
    step = pool.commit(plan)
    assert step.bucket == 256, (seed, B)
    fi.write_kv(step, k, v, cache)
    want = reference.run(plan, q.float(), cache)
    assert_close_per_request(fi.run(step, q, cache), want, plan, spec.dtype, (f"seed {seed}", B, "eager"))
    assert graphs.serves(step), (seed, B)
    assert_close_per_request(graphs(step, q=q), want, plan, spec.dtype, (f"seed {seed}", B, "replayed"))


def test_trees_past_16_tokens_replay_from_their_bucket():
    """A pool of max_tree_nodes=64 buckets tree steps of one size past MAX_VERIFY_Q_LEN (17..64 tokens, 1..8
    requests over prefixes 1..3000, chains, stars and random trees): captured for sizes 40 and 64, replayed and
    run eagerly, every request against the reference on the same cache."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(QH, KVH, D, PS, 6000)
    cache = random_cache(spec, seed)
    pool = gpu_pool(spec, buckets=(1, 2, 4, 8), max_pages_per_request=300, max_tree_nodes=64)
    graphs = DecodeGraphs(pool, lambda step, x: fi.run(marked(step, cache), x["q"], cache),
                          {"q": torch.zeros(8 * 64, QH, D, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(40, 64), trees=True)
    ran = {"replayed": 0, "eager bucketed": 0}
    for i in range(6):
        B, n = int(rng.integers(1, 9)), (40, 64)[i] if i < 2 else int(rng.choice([40, 64, int(rng.integers(17, 64))]))
        prefix = [int(rng.choice([1, PS * int(rng.integers(1, 100)), int(rng.integers(2, 3000))])) for _ in range(B)]
        plan, _, q, k, v = tree_step(rng, spec, [n] * B, prefix, [str(x) for x in rng.choice(["chain", "star", "random"], B)])
        step = pool.commit(plan)
        assert step.bucket is not None, (f"seed {seed}", i, n, B)
        fi.write_kv(step, k, v, cache)
        want = reference.run(plan, q.float(), cache)
        assert_close_per_request(fi.run(step, q, cache), want, plan, spec.dtype, (f"seed {seed}", i, "eager", n, B))
        ran["eager bucketed"] += 1
        if graphs.serves(step):
            assert_close_per_request(graphs(step, q=q), want, plan, spec.dtype, (f"seed {seed}", i, "replayed", n, B))
            ran["replayed"] += 1
    assert all(ran.values()), (f"seed {seed}", ran)
