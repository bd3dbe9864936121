"""kernels/_cascade.stage on the CPU: the level arrays a FlashInfer cascade step uploads, padded to
its bucket, computed by a float64 emulation of the two kernels (a non-causal paged prefill per
shared-level request, a causal paged attention per suffix request, base-2 LSEs, the masked merge,
the inverse permutation) equal the flat attention per request. The GPU test runs the real kernels
over the same arrays (tests/kernels/test_flashinfer_cascade.py)."""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from mstar_attn.kernels._cascade import shared_batch, stage, staging_entries
from tests.support.prefix_batches import prefix_batch

NUM_PAGES = 3000


def attend(q, pages, n, cache, causal, scale):
    """q [t, H, D] over the first n tokens of `pages` (bottom-right causal): output and base-2 LSE."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in cache.read(torch.tensor(pages), torch.float64))
    logits = torch.einsum("qhd,khd->hqk", q, k[:n]) * scale
    if causal:
        t = q.shape[0]
        logits = logits.masked_fill(torch.arange(n)[None] > torch.arange(n - t, n)[:, None], float("-inf"))
    lse = torch.logsumexp(logits, -1).transpose(0, 1) / math.log(2)
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v[:n]), lse


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16]), st.sampled_from([1, 3]), st.lists(st.integers(2, 5), min_size=1, max_size=4),
       st.integers(0, 4), st.sampled_from(["causal", "noncausal"]), st.integers(0, 2**31 - 1), st.booleans())
def test_staged_levels_compute_the_flat_attention(ps, q_len, families, loners, kind, seed, bucketed):
    spec = AttentionSpec(4, 2, 16, ps, NUM_PAGES, dtype=torch.float64, backend="reference", cascade="always",
                         groups=(LayerGroup(kind),))
    flat_spec = AttentionSpec(4, 2, 16, ps, NUM_PAGES, dtype=torch.float64, backend="reference", groups=(LayerGroup(kind),))
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=256, max_num_pages=NUM_PAGES,
                                            buckets=(8, 16, 32) if bucketed else (1,)), device="cpu")
    rng = np.random.default_rng(seed)
    q_lens, kv, pages = prefix_batch(rng, ps, q_len, NUM_PAGES, families, loners)
    batch = StepBatch.from_pages(q_lens, kv, pages, ps)
    plan, flat = build_plan(batch, spec), build_plan(batch, flat_spec)
    step = pool.commit(plan)
    assert (step.bucket is not None) == (bucketed and plan.batch_size <= 32 and (q_len == 1 or kind == "causal")), seed
    c, B, T, rows, R, Gf = plan.cascade, plan.batch_size, plan.num_tokens, step.padded_batch_size, step.padded_num_tokens, shared_batch(step)
    h = np.full(staging_entries(pool.layout), -7, np.int32)
    r = stage(h, c, B, rows, R, q_len, Gf, spec)
    assert r["shared_kv_indices"][1] <= h.shape[0] and (h[: r["shared_kv_indices"][1]] != -7).all(), seed
    a = {name: h[lo:hi] for name, (lo, hi) in r.items()}
    for name in ("suffix_kv_indices", "shared_kv_indices"):
        assert 0 <= a[name].min() and a[name].max() <= spec.scratch_page, (seed, name)
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(*(torch.randn(spec.cache_shape, generator=gen, dtype=torch.float64) for _ in range(2)))
    q = torch.randn(R, 4, 16, generator=gen, dtype=torch.float64)
    perm, inv = torch.from_numpy(a["perm"].astype(np.int64)), torch.from_numpy(a["inv"].astype(np.int64))
    qp = q[perm]
    o1, l1 = torch.zeros_like(qp), torch.full(qp.shape[:2], float("-inf"), dtype=torch.float64)
    qo, ptr = a["shared_qo_indptr"], a["shared_kv_indptr"]
    assert qo[-1] == R and (np.diff(qo) >= 0).all(), seed  # the rest request ends the shared level's rows
    for j in range(Gf):
        n = (ptr[j + 1] - ptr[j] - 1) * ps + a["shared_last_page_len"][j]
        assert n == a["shared_kv_lens"][j], (seed, j)
        if qo[j + 1] > qo[j]:
            o1[qo[j] : qo[j + 1]], l1[qo[j] : qo[j + 1]] = attend(
                qp[qo[j] : qo[j + 1]], a["shared_kv_indices"][ptr[j] : ptr[j + 1]], n, cache, False, spec.sm_scale)
    o2, l2 = torch.zeros_like(qp), torch.zeros(qp.shape[:2], dtype=torch.float64)
    xp = a["suffix_kv_indptr"]
    for j in range(rows):  # q_len rows each (decode, verify)
        n = (xp[j + 1] - xp[j] - 1) * ps + a["suffix_last_page_len"][j]
        assert n == a["suffix_kv_lens"][j] >= q_len, (seed, j)
        sl = slice(j * q_len, (j + 1) * q_len)
        o2[sl], l2[sl] = attend(qp[sl], a["suffix_kv_indices"][xp[j] : xp[j + 1]], n, cache, kind == "causal", spec.sm_scale)
    mask = torch.from_numpy(a["mask"].view(np.uint8)[:R].astype(bool))
    assert int(mask.sum()) == c.member_queries and bool(mask[: c.member_queries].all()), seed
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp2(l1 - m), torch.exp2(l2 - m)
    merged = torch.where(mask[:, None, None], (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None], o2)
    out = merged[inv]
    want = reference.run(flat, q[:T], cache)
    for i in range(B):
        lo, hi = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        err = ((out[lo:hi] - want[lo:hi]).norm() / want[lo:hi].norm()).item()
        assert err < 1e-12, (f"seed {seed}", f"request {i}", f"prefix group {c.prefixes.group_of[i]}", err)
