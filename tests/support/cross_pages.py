"""Encoder-decoder steps for the tests: a causal self-attention group beside a cross-attention group
(Kind.CROSS) whose pages hold each request's encoder K/V, stored once at the request's first step.

`CrossTrace` plays an engine: requests arrive with encoder inputs of 1 to `max_encoder` tokens and
decoder prompts of 1-4 tokens (a prompt of 1 beside decoding requests makes a decode step that
stores encoder K/V), decode, and leave; their pages go back and are reused. It keeps the true
decoder and encoder K/V, so `oracle` gives each group's exact attention.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from mstar_attn import AttentionSpec, CrossRows, GroupPages, LayerGroup, StepBatch, build_plan
from tests.support.exact import TrueKV, exact_attention

GROUPS = (LayerGroup(), LayerGroup("cross"))


@attrs.define
class _Request:
    encoder: int
    prompt: int
    target: int
    cached: int = 0
    pages: list = attrs.Factory(list)
    cross: list = attrs.Factory(list)
    row: int = -1  # its cross-table row (table mode)
    truth: TrueKV = attrs.Factory(TrueKV)  # its decoder tokens' true K / V (on the trace's device)
    enc_k: torch.Tensor | None = None
    enc_v: torch.Tensor | None = None


class CrossTrace:
    """Per step: `plan = trace.step(i)`; `k, v, k_enc, v_enc = trace.new_kv(plan)` (the decoder
    tokens' K/V [T, ...] and the encoder K/V stored this step [sum(new_lens), ...], or None);
    `trace.query(plan)`; `trace.oracle(plan, q, g)`; `trace.advance(plan)`.
    table: a pool's cross table: encoder pages are assigned to its rows at admission and steps
    name rows (CrossRows); None: steps list the pages (GroupPages.cross)."""

    def __init__(self, spec: AttentionSpec, seed: int, device="cpu", max_batch: int = 16, max_encoder: int = 3000,
                 table=None):
        self.spec, self.device, self.max_batch, self.max_encoder, self.table = spec, device, max_batch, max_encoder, table
        self.free_rows = [] if table is None else list(range(table.max_requests))
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = {name: [int(p) for p in self.rng.permutation(spec.num_pages)] for name in ("self", "cross")}
        self.live: list[_Request] = []
        self.batch: list[_Request] = []

    def _encoder_len(self) -> int:
        ps = self.spec.page_size
        return int(self.rng.choice([1, ps, ps + 1, int(self.rng.integers(1, self.max_encoder + 1))]))

    def step(self, i: int):
        for r in self.live:
            if r.cached >= r.target:
                self.free["self"] += r.pages
                self.free["cross"] += r.cross
                if self.table is not None:
                    assert sorted(self.table.release(r.row).tolist()) == sorted(r.cross)
                    self.free_rows.append(r.row)
        self.live = [r for r in self.live if r.cached < r.target]
        if i == 0 or (len(self.live) < self.max_batch and self.rng.random() < 0.4):
            for _ in range(4 if i == 0 else int(self.rng.integers(1, 3))):
                n = self._encoder_len()
                prompt = int(self.rng.choice([1, 1, 2, 4]))
                r = _Request(n, prompt, prompt + int(self.rng.integers(2, 30)), truth=TrueKV(self.device))
                r.cross = [self.free["cross"].pop() for _ in range(-(-n // self.spec.page_size))]
                if self.table is not None:  # (rows are taken from the front: freed rows come back late)
                    r.row = self.free_rows.pop(0)
                    self.table.assign(r.row, r.cross)
                self.live.append(r)
        self.batch = self.live[: self.max_batch]
        q = [r.prompt if r.cached == 0 else 1 for r in self.batch]
        ps = self.spec.page_size
        for r, n in zip(self.batch, q):
            r.pages += [self.free["self"].pop() for _ in range(-(-(r.cached + n) // ps) - len(r.pages))]
        kv = [r.cached + n for r, n in zip(self.batch, q)]
        lens, write = [r.encoder for r in self.batch], [r.cached == 0 for r in self.batch]
        if self.table is None:
            cross = GroupPages.cross([r.cross for r in self.batch], lens, write)
        else:
            cross = CrossRows.of([r.row for r in self.batch], lens, write)
        g = next(g for g, group in enumerate(self.spec.groups) if group.cross)
        return build_plan(StepBatch.from_pages(q, kv, [r.pages for r in self.batch], ps, group_pages={g: cross}), self.spec)

    def _randn(self, n: int, heads: int) -> torch.Tensor:
        return torch.randn((n, heads, self.spec.head_dim), generator=self.gen).to(self.spec.dtype)

    def new_kv(self, plan):
        """(k, v) of the step's decoder tokens and (k_enc, v_enc) of the encoder tokens it stores (None if none)."""
        H = self.spec.num_kv_heads
        k, v = self._randn(plan.num_tokens, H), self._randn(plan.num_tokens, H)
        enc = []
        for i, r in enumerate(self.batch):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            r.truth.append(k[a:b], v[a:b])
            if r.cached == 0:
                r.enc_k, r.enc_v = (self._randn(r.encoder, H).to(self.device) for _ in range(2))
                enc.append(r)
        k_enc = torch.cat([r.enc_k for r in enc]).to(self.device) if enc else None
        v_enc = torch.cat([r.enc_v for r in enc]).to(self.device) if enc else None
        return k.to(self.device), v.to(self.device), k_enc, v_enc

    def query(self, plan) -> torch.Tensor:
        return self._randn(plan.num_tokens, self.spec.num_qo_heads).to(self.device)

    def oracle(self, plan, q: torch.Tensor, group: int) -> torch.Tensor:
        """Exact attention [T, qo_heads, head_dim] of layer group `group`, float64 on the trace's device:
        causal over the decoder's K/V, or (the cross group) every query over all of the request's
        encoder K/V (support.exact)."""
        spec, cross = self.spec, self.spec.groups[group].cross
        out = torch.empty(q.shape, dtype=torch.float64, device=self.device)
        for i, r in enumerate(self.batch):
            a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
            k, v = (r.enc_k, r.enc_v) if cross else r.truth.kv()
            out[a:b] = exact_attention(q[a:b], k, v, scale=spec.sm_scale, soft_cap=spec.soft_cap, causal=not cross)
        return out

    def advance(self, plan) -> None:
        for r, n in zip(self.batch, plan.q_lens):
            r.cached += int(n)


def cross_layers(backend, caches, step, x: dict) -> torch.Tensor:
    """One self-attention layer (write_kv + run) and one cross-attention layer (run: its K/V were
    stored at the request's first step) through `backend`; [rows, 2, qo_heads, head_dim]."""
    backend.write_kv(step, x["k"], x["v"], caches[0], group=0)
    return torch.stack([backend.run(step, x["q"], caches[0], group=0), backend.run(step, x["q"], caches[1], group=1)], dim=1)


def serve(trace: CrossTrace, pool, backend, caches, steps: int, seed: int, graphs=None) -> dict:
    """`steps` steps of `trace` through `backend` (committed to `pool`, or plans for the reference
    with pool None): encoder K/V stored eagerly through write_kv(group=1) right after the commit,
    then both layers (a replay when `graphs` serves the step, equal to an eager call bit for bit);
    every request of both groups within the dtype's bounds of the exact attention. Returns step
    counts by (mode, replayed, stored encoder K/V)."""
    from tests.helpers import assert_close_per_request, replay_or_run, request_errors

    ran: dict = {}
    for i in range(steps):
        plan = trace.step(i)
        step = pool.commit(plan) if pool is not None else plan
        k, v, k_enc, v_enc = trace.new_kv(plan)
        if k_enc is not None:
            backend.write_kv(step, k_enc, v_enc, caches[1], group=1)
        x = {"q": trace.query(plan), "k": k, "v": v}
        out, replay = replay_or_run(graphs, step, x, lambda s, x: cross_layers(backend, caches, s, x), (f"seed {seed}", i, plan.mode))
        for g in range(2):
            want, context = trace.oracle(plan, x["q"], g), (f"seed {seed}", i, plan.mode, f"group {g}")
            if trace.spec.dtype == torch.float32:  # float32 sums over up to thousands of keys: ~1e-6 relative, bound 1e-5
                errs = [e for e, _, _ in request_errors(out[:, g], want, plan)]
                assert max(errs) < 1e-5, (context, f"request {int(np.argmax(errs))}", max(errs))
            else:
                assert_close_per_request(out[:, g], want, plan, trace.spec.dtype, context)
        trace.advance(plan)
        key = (plan.mode.value, replay, k_enc is not None)
        ran[key] = ran.get(key, 0) + 1
    return ran


def gpu_cross(backend, name: str, seed: int, page_size: int, rows: bool, steps: int = 25) -> dict:
    """The trace on the GPU through `backend` (a kernels module named `name`): 32 / 8 heads of 128,
    bf16, encoders of 1 to 3,000 tokens; decode steps of buckets 1, 8 and 16 replay one graph of the
    self layer's write_kv + run and the cross layer's run (encoder K/V stored eagerly before it),
    other steps run eagerly (see serve). rows: the encoder pages in the pool's cross table (CrossRows,
    gathered on the device), else listed by each step (GroupPages.cross)."""
    from mstar_attn.capture.graphs import DecodeGraphs
    from tests.helpers import gpu_pool, random_cache

    torch.manual_seed(seed)
    spec = AttentionSpec(32, 8, 128, page_size, 60000 // page_size + 2000, groups=GROUPS, layer_groups=(0, 1), backend=name)
    pool = gpu_pool(spec, buckets=(1, 8, 16), max_encoder_tokens=4 * 3000 * 2, max_requests=64 if rows else None)
    trace = CrossTrace(spec, seed, device="cuda", max_batch=16, max_encoder=3000, table=pool.cross_table)
    caches = [attrs.evolve(random_cache(spec, seed + g), group=g) for g in range(2)]
    static = {"q": torch.zeros(16, 32, 128, device="cuda", dtype=spec.dtype),
              "k": torch.zeros(16, 8, 128, device="cuda", dtype=spec.dtype),
              "v": torch.zeros(16, 8, 128, device="cuda", dtype=spec.dtype)}
    graphs = DecodeGraphs(pool, lambda step, x: cross_layers(backend, caches, step, x), static)
    graphs.capture()
    captured = {k for k in pool.device_work.graphs if k[0] == "cross"}
    if rows:  # every slot's cross-table work of every bucket, captured with the decode graphs (not mid-serving)
        assert captured == {("cross", s, b, b, 1) for s in range(pool.num_slots) for b in (1, 8, 16)}, captured
    ran = serve(trace, pool, backend, caches, steps, seed, graphs)
    assert ran.get(("decode", True, False)) and any(stored for *_, stored in ran), (f"seed {seed}", ran)
    assert {k for k in pool.device_work.graphs if k[0] == "cross"} == captured, f"seed {seed}: a commit captured its work"
    return ran
