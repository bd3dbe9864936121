"""Hybrid-model steps for the tests: a full layer group on the shared page list beside sliding-window
groups on their own page lists (LayerGroup.own_pages) that give back the pages their window has passed.

`HybridTrace` plays an engine: requests arrive (prompts shorter than, equal to and far longer than
the window), prefill beside others' decode tokens, decode, verify 4 tokens at a time, and leave.
After each step a request frees (most of the time; sometimes lazily later) the own-list pages no
later step can see, and later requests take them again, so stale K/V sits under reused pages. It
keeps every request's true K/V, so `oracle` gives the exact attention of any layer group.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from mstar_attn import AttentionSpec, GroupPages, StepBatch, build_plan
from tests.support.exact import TrueKV, exact_attention


@attrs.define
class _Request:
    prompt: int
    target: int  # leaves once it holds this many tokens
    cached: int = 0
    shared: list = attrs.Factory(list)  # shared-list pages, logical pages 0, 1, ...
    first: int = 0  # own list: logical page of own[0]
    own: list = attrs.Factory(list)
    truth: TrueKV = attrs.Factory(TrueKV)  # its true K / V (on the trace's device)


class HybridTrace:
    """An engine over `spec` (its own_pages groups share one own list here, a window W_max of the
    widest of them). Per step: `plan = trace.step(i)`, then `k, v = trace.new_kv(plan)` (the tokens'
    K/V, to write through write_kv), `trace.oracle(plan, q, g)`, and `trace.advance(plan)`."""

    def __init__(self, spec: AttentionSpec, seed: int, device="cpu", max_batch: int = 32, max_prompt: int = 200,
                 lazy: float = 0.25):
        self.spec, self.device, self.max_batch, self.max_prompt, self.lazy = spec, device, max_batch, max_prompt, lazy
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.window = max(spec.groups[g].window for g in spec.own_page_groups)
        self.free = {name: [int(p) for p in self.rng.permutation(spec.num_pages)] for name in ("shared", "own")}
        self.live: list[_Request] = []
        self.batch: list[_Request] = []
        self.given_back = 0  # own-list pages given back before their request left (the window had passed them)

    def _prompt(self) -> int:
        W = self.window
        return int(self.rng.choice([1, max(W - 1, 1), W, W + 1, int(self.rng.integers(1, self.max_prompt + 1))]))

    def step(self, i: int):
        """The plan of step i: arrivals prefill beside decode tokens, else every 3rd step a verify of
        4 tokens per request, else decode."""
        self.live = [r for r in self.live if r.cached < r.target or self._leave(r)]
        new = []
        if i == 0 or (len(self.live) < self.max_batch and self.rng.random() < 0.35):
            for _ in range(6 if i == 0 else int(self.rng.integers(1, 4))):
                p = self._prompt()
                new.append(_Request(p, p + int(self.rng.integers(3, 80)), truth=TrueKV(self.device)))
        verify = not new and i % 3 == 1
        self.batch = (self.live + new)[: self.max_batch]
        self.live = self.live + new
        q = [r.prompt if r.cached == 0 else 4 if verify else 1 for r in self.batch]
        ps = self.spec.page_size
        for r, n in zip(self.batch, q):
            need = -(-(r.cached + n) // ps)
            r.shared += [self.free["shared"].pop() for _ in range(need - len(r.shared))]
            spare = int(self.rng.random() < 0.2)  # sometimes a page more than the step needs (held for later)
            r.own += [self.free["own"].pop() for _ in range(max(need - r.first - len(r.own) + spare, 0))]
        kv = [r.cached + n for r, n in zip(self.batch, q)]
        own = GroupPages.from_pages([r.first for r in self.batch], [r.own for r in self.batch])
        batch = StepBatch.from_pages(q, kv, [r.shared for r in self.batch], ps,
                                     group_pages={g: own for g in self.spec.own_page_groups})
        return build_plan(batch, self.spec)

    def new_kv(self, plan, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K, V [T, kv_heads, head_dim] for the step's tokens (spec dtype, on the device), kept as the truth."""
        shape = (plan.num_tokens, self.spec.num_kv_heads, self.spec.head_dim)
        k, v = (torch.randn(shape, generator=self.gen).to(dtype or self.spec.dtype) for _ in range(2))
        for i, r in enumerate(self.batch):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            r.truth.append(k[a:b], v[a:b])
        return k.to(self.device), v.to(self.device)

    def query(self, plan, dtype=None) -> torch.Tensor:
        shape = (plan.num_tokens, self.spec.num_qo_heads, self.spec.head_dim)
        return torch.randn(shape, generator=self.gen).to(dtype or self.spec.dtype).to(self.device)

    def oracle(self, plan, q: torch.Tensor, group: int) -> torch.Tensor:
        """The exact attention [T, qo_heads, head_dim] of layer group `group` for the step's queries q
        [T, qo_heads, head_dim], float64 on the trace's device: each request's queries over its true
        K/V with the group's mask (support.exact)."""
        g, spec = self.spec.groups[group], self.spec
        out = torch.empty(q.shape, dtype=torch.float64, device=self.device)
        for i, r in enumerate(self.batch):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            k, v = r.truth.kv()
            out[a:b] = exact_attention(q[a:b], k, v, scale=spec.sm_scale, soft_cap=spec.soft_cap, causal=g.causal,
                                       window=g.window or 0)
        return out

    def advance(self, plan) -> None:
        """The step ran: each request's cache holds its new tokens; own pages no later step can see
        go back to the free list (left for a later step a quarter of the time)."""
        ps = self.spec.page_size
        for r, n in zip(self.batch, plan.q_lens):
            r.cached += int(n)
            keep = max(r.cached - (self.window - 1), 0) // ps  # the next step's window starts on this page
            if keep > r.first and self.rng.random() >= self.lazy:
                self.free["own"] += r.own[: keep - r.first]
                self.given_back += keep - r.first
                r.own, r.first = r.own[keep - r.first :], keep

    def _leave(self, r: _Request) -> bool:
        self.free["shared"] += r.shared
        self.free["own"] += r.own
        return False


def hybrid_layers(backend, caches, step, x: dict) -> torch.Tensor:
    """One layer of each group through `backend` (a kernels module): write_kv then run, per group
    its own cache; returns the outputs stacked [rows, groups, qo_heads, head_dim] (rows first, as
    DecodeGraphs slices its output's rows)."""
    outs = []
    for g, cache in enumerate(caches):
        backend.write_kv(step, x["k"], x["v"], cache, group=g)
        outs.append(backend.run(step, x["q"], cache, group=g))
    return torch.stack(outs, dim=1)


def serve(trace: HybridTrace, pool, backend, caches, steps: int, seed: int, graphs=None) -> dict:
    """`steps` steps of `trace` committed to `pool` and run through `backend`: every group's output,
    per request, within the dtype's bounds of the exact attention (trace.oracle). With `graphs` (a
    DecodeGraphs of hybrid_layers), bucketed decode and verify steps replay, and equal an eager call
    on the same step bit for bit. Returns how many steps ran, by (mode, replayed)."""
    from tests.helpers import assert_close_per_request, replay_or_run

    ran: dict = {}
    for i in range(steps):
        plan = trace.step(i)
        step = pool.commit(plan)
        k, v = trace.new_kv(plan)
        x = {"q": trace.query(plan), "k": k, "v": v}
        out, replay = replay_or_run(graphs, step, x, lambda s, x: hybrid_layers(backend, caches, s, x), (f"seed {seed}", i, plan.mode))
        for g in range(len(caches)):
            want = trace.oracle(plan, x["q"], g)
            assert_close_per_request(out[:, g], want, plan, trace.spec.dtype, (f"seed {seed}", i, plan.mode, f"group {g}"))
        trace.advance(plan)
        key = (plan.mode.value, replay)
        ran[key] = ran.get(key, 0) + 1
    return ran


def gpu_hybrid(backend, name: str, seed: int, steps: int = 40) -> dict:
    """The trace on the GPU through `backend` (a kernels module named `name`): 32 / 8 heads of 128,
    page 16, a full group and a window of 40 on its own list; decode and verify steps of buckets 1,
    8 and 32 replay one graph of both groups' write_kv + run, other steps run eagerly (see serve)."""
    from mstar_attn import LayerGroup
    from mstar_attn.capture.graphs import DecodeGraphs
    from tests.helpers import gpu_pool, random_cache

    torch.manual_seed(seed)
    groups = (LayerGroup(), LayerGroup("window", window=40, own_pages=True))
    spec = AttentionSpec(32, 8, 128, 16, 12000, groups=groups, layer_groups=(0, 1), backend=name)
    trace = HybridTrace(spec, seed, device="cuda", max_batch=32, max_prompt=300)
    pool = gpu_pool(spec, buckets=(1, 8, 32), max_pages_per_request=400)
    caches = [attrs.evolve(random_cache(spec, seed + g), group=g) for g in range(2)]
    rows = 32 * 4
    static = {"q": torch.zeros(rows, 32, 128, device="cuda", dtype=spec.dtype),
              "k": torch.zeros(rows, 8, 128, device="cuda", dtype=spec.dtype),
              "v": torch.zeros(rows, 8, 128, device="cuda", dtype=spec.dtype)}
    graphs = DecodeGraphs(pool, lambda step, x: hybrid_layers(backend, caches, step, x), static)
    graphs.capture(q_lens=(1, 4))
    ran = serve(trace, pool, backend, caches, steps, seed, graphs)
    assert ran.get(("decode", True)) and ran.get(("verify", True)), (f"seed {seed}", ran)
    assert trace.given_back > 0, f"seed {seed}"
    return ran
