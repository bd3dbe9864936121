"""Shared test helpers: random batches, a naive float64 oracle, filling a paged cache."""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn import AttentionSpec, Kind, LayerGroup, PagedKVCache, StepBatch, build_plan
from mstar_attn.kernels import reference


def random_pages(rng: np.random.Generator, kv_lens, page_size: int, num_pages: int, extra: int = 0) -> list[np.ndarray]:
    """Distinct random pages for each request: exactly what it needs plus up to `extra` spare."""
    need = [(int(k) + page_size - 1) // page_size for k in kv_lens]
    counts = [n + int(rng.integers(0, extra + 1)) for n in need]
    perm = rng.permutation(num_pages)[: sum(counts)].astype(np.int32)
    return np.split(perm, np.cumsum(counts)[:-1])


def random_batch(rng, q_lens, kv_lens, page_size: int, num_pages: int, extra: int = 0) -> StepBatch:
    pages = random_pages(rng, kv_lens, page_size, num_pages, extra)
    return StepBatch.from_pages(q_lens, kv_lens, pages, page_size)


def naive_attention(q, k, v, *, kind: Kind, window: int | None, scale: float, soft_cap: float = 0.0) -> torch.Tensor:
    """One sequence in float64, queries at the end: q [n_q, Hq, D], k and v [n_k, Hkv, D]."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    n_q, n_k, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        logits = q[:, h] @ k[:, h // rep].T * scale
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        pos = torch.arange(n_k - n_q, n_k)[:, None]  # absolute position of each query
        key = torch.arange(n_k)[None, :]
        visible = torch.ones(n_q, n_k, dtype=torch.bool)
        if kind is not Kind.NONCAUSAL:
            visible &= key <= pos
        if kind is Kind.WINDOW:
            visible &= key > pos - window
        logits = logits.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(logits, dim=-1) @ v[:, h // rep]
    return out


def fill_prefix(cache: PagedKVCache, batch: StepBatch, k_seqs, v_seqs) -> None:
    """Write each request's cached prefix (kv_len - q_len tokens) straight into its pages."""
    ps = cache.page_size
    for i in range(batch.batch_size):
        pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
        n = int(batch.kv_lens[i] - batch.q_lens[i])
        for p in range(n):
            cache.k[pages[p // ps], p % ps] = k_seqs[i][p]
            cache.v[pages[p // ps], p % ps] = v_seqs[i][p]


def spec_for(page_size=16, num_pages=512, dtype=torch.float32, groups=(LayerGroup(),), heads=(4, 2), head_dim=16, **kw):
    return AttentionSpec(heads[0], heads[1], head_dim, page_size, num_pages, dtype=dtype, groups=groups,
                         backend=kw.pop("backend", "reference"), **kw)


def make_step(seed, q_lens, kv_lens, page_size, dtype=torch.float32, groups=(LayerGroup(),), soft_cap=0.0, heads=(4, 2),
              head_dim=16, device="cpu", backend="reference", write=True):
    """A random step with its cache filled: the prefix written directly, the new tokens by the
    reference write_kv unless write=False. Returns spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum((k + page_size - 1) // page_size for k in kv_lens)
    spec = spec_for(page_size=page_size, num_pages=need + len(kv_lens) + 7, dtype=dtype, groups=groups, soft_cap=soft_cap,
                    heads=heads, head_dim=head_dim, backend=backend)
    batch = random_batch(rng, q_lens, kv_lens, page_size, spec.num_pages, extra=1)
    cache = PagedKVCache.allocate(spec, device)
    for t in (cache.k, cache.v):  # poison: stale data everywhere
        t.copy_(torch.randn(t.shape, generator=gen))
    shape = lambda n: (n, spec.num_kv_heads, spec.head_dim)  # noqa: E731
    k_seqs = [torch.randn(shape(n), generator=gen).to(dtype).to(device) for n in kv_lens]
    v_seqs = [torch.randn(shape(n), generator=gen).to(dtype).to(device) for n in kv_lens]
    fill_prefix(cache, batch, k_seqs, v_seqs)
    plan = build_plan(batch, spec)
    new = lambda seqs: torch.cat([s[k - q :] for s, q, k in zip(seqs, q_lens, kv_lens)])  # noqa: E731
    k_new, v_new = new(k_seqs), new(v_seqs)
    if write:
        reference.write_kv(plan, k_new, v_new, cache)
    q = torch.randn((plan.num_tokens, spec.num_qo_heads, spec.head_dim), generator=gen).to(dtype).to(device)
    return spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new


# the layer groups the GPU backend tests cover: full causal, a sliding window, non-causal
GPU_GROUPS = (LayerGroup(), LayerGroup("window", window=40), LayerGroup("noncausal"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative error of a against b, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gpu_pool(spec, **kw):
    """A GraphBufferPool on CUDA sized for the GPU tests' steps."""
    from mstar_attn.capture.pool import GraphBufferPool

    return GraphBufferPool(spec, max_batch_size=kw.pop("max_batch_size", 300), max_num_tokens=4096,
                           max_num_pages=spec.num_pages, device="cuda", **kw)


def many_steps(run, backend: str, tol: float, **pool_kw) -> None:
    """200 changing steps through one GPU backend, eager and replayed, against the reference.

    run(step, q, cache, group=g): the backend's run. Batch sizes cross buckets and go past the
    largest; decode and verify (q_len 4) steps replay captured graphs, other modes run eagerly.
    Every output is within tol of the reference, and a replay equals the eager call bit for bit
    (same kernel, same inputs).
    """
    from mstar_attn.capture.graphs import DecodeGraphs
    from mstar_attn.capture.pool import GraphBufferPool

    rng = np.random.default_rng()
    spec = AttentionSpec(32, 8, 128, 16, 6000, groups=GPU_GROUPS[:2], backend=backend)
    cache = PagedKVCache(torch.randn(6000, 16, 8, 128, device="cuda", dtype=torch.bfloat16),
                         torch.randn(6000, 16, 8, 128, device="cuda", dtype=torch.bfloat16))
    pool = GraphBufferPool(spec, max_batch_size=80, max_num_tokens=1024, max_num_pages=6000, buckets=(1, 4, 16, 32), **pool_kw)
    q_static = torch.zeros(32 * 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    graphs = {g: DecodeGraphs(pool, lambda step, x, g=g: run(step, x["q"], cache, group=g), {"q": q_static}) for g in range(2)}
    for gr in graphs.values():
        gr.capture(q_lens=(1, 4))
    replayed = {1: 0, 4: 0}
    for i in range(200):
        B = int(rng.choice([1, 3, 4, 9, 16, 31, 32, 33, 70]))
        kv = rng.integers(5, 1200, B)
        if i % 5 == 0:
            q_lens = np.minimum(kv, rng.integers(1, 6, B))
        elif i % 5 == 1:
            q_lens = np.full(B, 4, np.int32)  # verify
        else:
            q_lens = np.ones(B, np.int32)
        plan = build_plan(random_batch(rng, q_lens, kv, 16, 6000), spec)
        step = pool.commit(plan)
        q = torch.randn(plan.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
        for g in range(2):
            want = reference.run(plan, q, cache, group=g)
            eager = run(step, q, cache, group=g)
            graph = graphs[g](step, q=q)
            if graphs[g].serves(step):
                replayed[step.q_len] += 1
            assert rel_err(eager, want) < tol, (i, B, g, plan.mode)
            assert torch.equal(graph, eager), (i, B, g, plan.mode)
    assert replayed[1] > 150 and replayed[4] > 30, replayed


def no_sync_on_the_step_path(backend, gpu_step, seed: int) -> None:
    """Commits, write_kv, a replayed decode and an eager prefill through `backend` (a kernels
    module) under torch.cuda.set_sync_debug_mode("error"): any device sync raises.
    gpu_step(seed, q_lens, kv_lens) -> make_step's tuple for this backend on CUDA."""
    from mstar_attn.capture.graphs import DecodeGraphs

    spec, plan, cache, q, _, _, k_new, v_new = gpu_step(seed, [1] * 6, [10, 20, 30, 40, 50, 4000])
    pool = gpu_pool(spec)
    static = torch.zeros(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    graphs = DecodeGraphs(pool, lambda step, x: backend.run(step, x["q"], cache), {"q": static})
    graphs.capture((8,))
    prefill = build_plan(random_batch(np.random.default_rng(seed), [5, 9], [5, 30], 16, spec.num_pages), spec)
    for p in (plan, prefill):  # warm (compile) both paths
        backend.run(pool.commit(p), torch.randn(p.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16), cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            decode = build_plan(random_batch(np.random.default_rng(seed), [1] * 6, [10, 20, 30, 40, 50, 4000], 16, spec.num_pages), spec)
            step = pool.commit(decode)
            backend.write_kv(step, k_new, v_new, cache)
            graphs(step, q=q)
            step = pool.commit(prefill)
            backend.run(step, torch.ones(prefill.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16), cache)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


class DoneEvent:
    """Stands in for torch.cuda.Event in CPU tests of GPU code paths: always already done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass
