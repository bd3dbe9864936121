"""Scenarios every GPU paged backend runs (tests/kernels/test_paged_backends.py): a walk of hundreds of
changing steps, no device sync on the step path, every mode over a backend's kernel combos, decode and
verify replays equal to eager calls, page-table steps; each against the reference per request."""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn import AttentionSpec, PagedKVCache, StepBatch, build_plan
from mstar_attn.kernels import reference
from tests.helpers import (
    GPU_GROUPS, assert_close_per_request, attend_filled, gpu_pool, marked, pool_of, random_batch, random_cache,
)


def many_steps(run, backend: str, seed: int, steps: int = 200, **pool_kw) -> None:
    """`steps` changing steps through one GPU backend, eager and replayed, against the reference, per request.

    run(step, q, cache, group=g): the backend's run. Batch sizes cross buckets and go past the
    largest; decode and verify (q_len 4) steps replay captured graphs, other modes run eagerly.
    Every request's output is within the per-request bounds of the reference, and a replay equals
    the eager call bit for bit (same kernel, same inputs). seed: printed with every failure.
    """
    from mstar_attn.capture.graphs import DecodeGraphs

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # q below: the printed seed replays the whole run
    spec = AttentionSpec(32, 8, 128, 16, 6000, groups=GPU_GROUPS[:2], backend=backend)
    cache = random_cache(spec, seed)
    pool = pool_of(spec, max_batch_size=80, max_num_tokens=1024, max_num_pages=6000, buckets=(1, 4, 16, 32), **pool_kw)
    q_static = torch.zeros(32 * 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    graphs = {g: DecodeGraphs(pool, attend_filled(run, cache, g), {"q": q_static}) for g in range(2)}
    for gr in graphs.values():
        gr.capture(q_lens=(1, 4))
    replayed = {1: 0, 4: 0}
    for i in range(steps):
        B = int(rng.choice([1, 3, 4, 9, 16, 31, 32, 33, 70]))
        kv = rng.integers(5, 1200, B)
        if i % 5 == 0:
            q_lens = np.minimum(kv, rng.integers(1, 6, B))
        elif i % 5 == 1:
            q_lens = np.full(B, 4, np.int32)  # verify
        else:
            q_lens = np.ones(B, np.int32)
        plan = build_plan(random_batch(rng, q_lens, kv, 16, spec.num_pages), spec)
        step = marked(pool.commit(plan), cache)  # (random K/V already at every slot)
        q = torch.randn(plan.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
        for g in range(2):
            want = reference.run(plan, q.float(), cache, group=g)
            eager = run(step, q, cache, group=g)
            graph = graphs[g](step, q=q)
            if graphs[g].serves(step):
                replayed[step.q_len] += 1
            assert_close_per_request(eager, want, plan, torch.bfloat16, (f"seed {seed}", i, B, g, plan.mode))
            assert torch.equal(graph, eager), (f"seed {seed}", i, B, g, plan.mode)
    assert replayed[1] > steps * 3 // 4 and replayed[4] > steps * 3 // 20, replayed


def no_sync_on_the_step_path(backend, gpu_step, seed: int) -> None:
    """Commits, write_kv, a replayed decode and an eager prefill (write_kv, run) through `backend` (a kernels
    module) under torch.cuda.set_sync_debug_mode("error"): any device sync raises.
    gpu_step(seed, q_lens, kv_lens) -> make_step's tuple for this backend on CUDA."""
    from mstar_attn.capture.graphs import DecodeGraphs

    torch.manual_seed(seed)
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, [1] * 6, [10, 20, 30, 40, 50, 4000])
    pool = gpu_pool(spec)
    static = torch.zeros(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    graphs = DecodeGraphs(pool, attend_filled(backend.run, cache), {"q": static})  # (write_kv: eagerly, below)
    graphs.capture((8,))
    prefill = build_plan(random_batch(np.random.default_rng(seed), [5, 9], [5, 30], 16, spec.num_pages), spec)
    kv = lambda p: torch.ones(p.num_tokens, spec.num_kv_heads, 128, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    for p in (plan, prefill):  # warm (compile) both paths
        step = pool.commit(p)
        backend.write_kv(step, kv(p), kv(p), cache)
        backend.run(step, torch.randn(p.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16), cache)
    k_pre, v_pre = kv(prefill), kv(prefill)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            decode = build_plan(random_batch(np.random.default_rng(seed), [1] * 6, [10, 20, 30, 40, 50, 4000], 16, spec.num_pages), spec)
            step = pool.commit(decode)
            backend.write_kv(step, k_new, v_new, cache)
            graphs(step, q=q)
            step = pool.commit(prefill)
            backend.write_kv(step, k_pre, v_pre, cache)
            backend.run(step, torch.ones(prefill.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16), cache)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# The modes every backend test covers, on one batch each: (q_lens, kv_lens, mode).
MODES = [
    ([1] * 5, [1, 17, 64, 300, 4100], "decode"),  # 5 rows, bucket 8: three padding rows
    ([5, 33, 200], [5, 33, 200], "prefill"),
    ([7, 20], [90, 21], "extend"),
    ([1, 30, 1, 4], [50, 30, 2, 100], "mixed"),
    ([4, 4, 4], [5, 40, 129], "verify"),
]


def check_modes(backend, gpu_step, combo: dict, q_lens, kv_lens, mode: str, seed: int) -> None:
    """One step of `mode` through `backend` (a kernels module): write_kv equals the reference's
    bit for bit, and every group's run matches the float32 reference per request."""
    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, q_lens, kv_lens, **combo)
    assert plan.mode.value == mode, (seed, plan.mode)
    step = gpu_pool(spec).commit(plan)
    backend.write_kv(step, k_new, v_new, cache)
    ref_cache = PagedKVCache(cache.k.clone(), cache.v.clone())
    reference.write_kv(plan, k_new, v_new, ref_cache)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v), f"seed {seed}"
    for g in range(len(spec.groups)):
        out = backend.run(step, q, cache, group=g, k=k_new, v=v_new)
        want = reference.run(plan, q.float(), cache, group=g)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close_per_request(out, want, plan, spec.dtype, (f"seed {seed}", combo, mode, spec.groups[g]))


def check_replay(backend, gpu_step, combo: dict, seed: int) -> None:
    """Decode (5 requests) and verify (3 requests, q_len 4) captured through DecodeGraphs at bucket
    8, both slots, every group of the combo, write_kv inside the graph: the replay equals the eager
    call on the real rows bit for bit, and both match the reference per request. (Verify is
    bucketed only when every group is causal: combos with a non-causal group replay decode only.)"""
    from mstar_attn.capture.graphs import DecodeGraphs

    verify = all(g.causal for g in combo.get("groups", GPU_GROUPS))
    for q_lens, kv_lens in (([1] * 5, [1, 17, 64, 300, 4100]), ([4] * 3, [5, 40, 129]))[: 1 + verify]:
        spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, q_lens, kv_lens, **combo)
        pool = gpu_pool(spec, buckets=(8,))
        rows = 8 * plan.max_q_len
        static = {"q": torch.zeros(rows, spec.num_qo_heads, spec.head_dim, device="cuda", dtype=spec.dtype),
                  "k": torch.zeros(rows, spec.num_kv_heads, spec.head_dim, device="cuda", dtype=spec.dtype),
                  "v": torch.zeros(rows, spec.num_kv_heads, spec.head_dim, device="cuda", dtype=spec.dtype)}

        def layer(step, x, g):
            backend.write_kv(step, x["k"], x["v"], cache)
            return backend.run(step, x["q"], cache, group=g)

        graphs = [DecodeGraphs(pool, lambda step, x, g=g: layer(step, x, g), static) for g in range(len(spec.groups))]
        for gr in graphs:
            gr.capture(q_lens=(plan.max_q_len,))
        for _ in range(2):  # one step per slot
            step = pool.commit(plan)
            for g, gr in enumerate(graphs):
                replayed = gr(step, q=q, k=k_new, v=v_new).clone()
                assert gr.serves(step), (seed, combo)
                eager = layer(step, {"q": q, "k": k_new, "v": v_new}, g)
                assert torch.equal(replayed, eager), (f"seed {seed}", combo, plan.mode, g)
                want = reference.run(plan, q.float(), cache, group=g)
                assert_close_per_request(eager, want, plan, spec.dtype, (f"seed {seed}", combo, plan.mode, g))


def table_steps(run, write_kv, backend: str, seed: int, steps: int = 30, heads=(32, 8), **pool_kw) -> dict:
    """`steps` StepRows steps through one GPU backend over a pool's page table: requests arrive
    (some sharing a prefix read-only), grow a page at a time and leave; decode and verify steps
    replay captured graphs (buckets up to 128, past the FlashInfer fixed-schedule threshold, and
    the bucket's plan made at capture on one-token scratch steps), other modes run eagerly.
    Every output is checked per request against the reference on the same pages given as a
    StepBatch, and write_kv against the reference's; replays equal eager calls bit for bit.
    Returns how many steps of each bucket (None: eager) ran."""
    from mstar_attn.capture.graphs import DecodeGraphs
    from mstar_attn.metadata.batch import StepRows

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    ps, hq, hkv = 16, heads[0], heads[1]
    spec = AttentionSpec(hq, hkv, 128, ps, 40000, groups=GPU_GROUPS[:2], backend=backend)
    cache = random_cache(spec, seed)
    pool = pool_of(spec, max_batch_size=160, max_num_tokens=2048, max_num_pages=spec.num_pages,
                   buckets=(1, 8, 32, 128), max_requests=200, max_pages_per_request=400, **pool_kw)
    table = pool.table
    static = {"q": torch.zeros(128 * 4, hq, 128, device="cuda", dtype=torch.bfloat16),
              "k": torch.zeros(128 * 4, hkv, 128, device="cuda", dtype=torch.bfloat16),
              "v": torch.zeros(128 * 4, hkv, 128, device="cuda", dtype=torch.bfloat16)}

    def layer(step, x, g):
        write_kv(step, x["k"], x["v"], cache)
        return run(step, x["q"], cache, group=g)

    graphs = [DecodeGraphs(pool, lambda s, x, g=g: layer(s, x, g), static) for g in range(2)]
    for gr in graphs:
        gr.capture(q_lens=(1, 4))
    free = list(rng.permutation(spec.num_pages).astype(np.int32))
    kv_len = {}  # row -> tokens in the cache
    counts: dict = {}
    prefix = [free.pop() for _ in range(4)]  # 64 tokens some requests share, read-only
    for i in range(steps):
        while len(kv_len) < (150 if i < 2 else int(rng.choice([5, 30, 100, 150]))) and len(kv_len) < 190:  # arrivals
            row = int(rng.choice([r for r in range(200) if r not in kv_len]))
            n = int(rng.integers(1, 2000))
            if rng.random() < 0.3 and n > 64 + ps:
                table.assign(row, prefix, shared=True)
            own = -(-n // ps) - int(table.counts[row])
            table.assign(row, [free.pop() for _ in range(own)])
            kv_len[row] = n - 1
        for row in rng.choice(list(kv_len), int(rng.integers(0, 3)), replace=False):  # departures
            free.extend(p for p in table.release(int(row)).tolist() if p not in prefix)  # (the prefix stays shared)
            del kv_len[row]
        live = sorted(kv_len)
        B = min(len(live), int(rng.choice([1, 7, 8, 30, 32, 100, 128, 150]))) if i % 3 else min(len(live), 128)
        rows = np.array(rng.choice(live, B, replace=False), np.int32)
        q_len = 4 if i % 4 == 1 else 1
        if i % 6 == 5 and B > 1:  # an eager mixed step
            q = np.where(np.arange(B) % 2, 1, rng.integers(2, 9, B)).astype(np.int32)
        else:
            q = np.full(B, q_len, np.int32)
        kv = np.array([kv_len[r] for r in rows], np.int32) + q
        grow = [(r, -(-int(k) // ps) - int(table.counts[r])) for r, k in zip(rows, kv)]
        single = [int(r) for r, n in grow if n == 1]
        table.append(single, [free.pop() for _ in single])  # decode growth: one call for every request
        for r, n in grow:
            if n > 1:
                table.assign(int(r), [free.pop() for _ in range(n)])
        plan = build_plan(StepRows(rows, q, kv), spec)
        step = pool.commit(plan)
        csr = build_plan(StepBatch.from_pages(q, kv, [table.pages(int(r))[: -(-int(k) // ps)] for r, k in zip(rows, kv)], ps),
                         spec, check_ownership=False)
        qx = torch.randn(plan.num_tokens, hq, 128, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = (torch.randn(plan.num_tokens, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref_cache = PagedKVCache(cache.k.clone(), cache.v.clone())
        reference.write_kv(csr, k_new, v_new, ref_cache)
        x = {"q": qx, "k": k_new, "v": v_new}
        for g in range(2):
            out = (graphs[g](step, **x) if graphs[g].serves(step) else layer(step, x, g)).clone()
            # (padding rows of a replay write the scratch page, the last: no request's page)
            assert torch.equal(cache.k[:-1], ref_cache.k[:-1]) and torch.equal(cache.v[:-1], ref_cache.v[:-1]), (f"seed {seed}", i, g)
            want = reference.run(csr, qx.float(), ref_cache, group=g)
            assert_close_per_request(out, want, csr, torch.bfloat16, (f"seed {seed}", i, B, g, plan.mode, step.bucket))
            if graphs[g].serves(step):
                assert torch.equal(out, layer(step, x, g)), (f"seed {seed}", i, g)
        counts[step.bucket] = counts.get(step.bucket, 0) + 1
        for r, k in zip(rows, kv):
            kv_len[int(r)] = int(k)
    return counts


def steady_steps(run, write_kv, backend: str, seed: int, steps: int = 30, lists: bool = False) -> dict[int, int]:
    """Decode walks over fixed rows, one token a step, committed with defer=True and replayed (lists: each step
    given as a StepBatch listing the rows' pages, ownership checked, instead of StepRows): B = 3 (bucket 8:
    FlashInfer's split-KV, chunk counts changing on the way; every page given up front) and B = 100 (bucket 128:
    its fixed schedule; each request given the pages of its first step, then one more (table.append) whenever its
    next token starts a page, as an engine's decode loop does), a full and a window group. Steps whose lengths
    stay in their slot's ranges are steady commits (capture/steady.py), appends included. Every output per
    request against the reference on the same pages given as a StepBatch, and the cache against the reference's
    write_kv. Returns the steady commits per B."""
    from mstar_attn.capture.graphs import DecodeGraphs
    from mstar_attn.metadata.batch import StepRows

    rng = np.random.default_rng(seed)
    ps = 16
    spec = AttentionSpec(32, 8, 128, ps, 9000, groups=GPU_GROUPS[:2], backend=backend)
    cache = random_cache(spec, seed)
    pool = pool_of(spec, max_batch_size=128, max_num_tokens=512, max_num_pages=spec.num_pages, buckets=(8, 128),
                   max_requests=200, max_pages_per_request=100)
    static = {n: torch.zeros(128, h, 128, device="cuda", dtype=torch.bfloat16) for n, h in (("q", 32), ("k", 8), ("v", 8))}

    def layer(step, x, g):
        write_kv(step, x["k"], x["v"], cache)
        return run(step, x["q"], cache, group=g)

    graphs = [DecodeGraphs(pool, lambda s, x, g=g: layer(s, x, g), static) for g in range(2)]
    for gr in graphs:
        gr.capture(q_lens=(1,))
    free = list(rng.permutation(spec.num_pages).astype(np.int32))
    counts = {}
    for B, first_row, ahead in ((3, 0, steps), (100, 100, 1)):
        rows = np.arange(first_row, first_row + B, dtype=np.int32)
        kv = rng.integers(10, 1400, B).astype(np.int32)
        for r, k in zip(rows, kv):
            pool.table.assign(int(r), [free.pop() for _ in range(-(-(int(k) + ahead) // ps))])
        ones, n0 = np.ones(B, np.int32), pool.steady.commits
        for i in range(steps):
            kv = kv + 1
            grow = rows[kv > pool.table.counts[rows] * ps]  # (their new token starts a page past the ones they hold)
            if grow.shape[0]:
                pool.table.append(grow, [free.pop() for _ in grow])
            listed = StepBatch.from_pages(ones, kv, [pool.table.pages(int(r))[: -(-int(k) // ps)] for r, k in zip(rows, kv)], ps)
            plan = build_plan(listed, spec) if lists else build_plan(StepRows.decode(rows, kv), spec)
            step = pool.commit(plan, defer=True)
            csr = build_plan(listed, spec, check_ownership=False)  # (the reference's: its arrays derived on the host)
            x = {n: torch.randn(B, h, 128, device="cuda", dtype=torch.bfloat16) for n, h in (("q", 32), ("k", 8), ("v", 8))}
            ref_cache = PagedKVCache(cache.k.clone(), cache.v.clone())
            reference.write_kv(csr, x["k"], x["v"], ref_cache)
            for g in range(2):
                out = graphs[g](step, **x)[:B].clone()
                assert torch.equal(cache.k[:-1], ref_cache.k[:-1]) and torch.equal(cache.v[:-1], ref_cache.v[:-1]), (f"seed {seed}", B, i, g)
                want = reference.run(csr, x["q"].float(), ref_cache, group=g)
                assert_close_per_request(out, want, csr, torch.bfloat16, (f"seed {seed}", B, i, g, step.bucket))
        counts[B] = pool.steady.commits - n0
    return counts
