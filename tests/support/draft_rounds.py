"""Speculative draft rounds for the tests: `DraftTrace` plays an engine's draft model round after round.

Each round every live request drafts K tokens (step j writes token j and reads kv + j tokens),
then "verification" keeps a random 1..K of the drafted positions; the K/V past the kept length
stays in the cache (rejected drafts), and the trace overwrites it with large values (x30) that
would wreck any output that read them. Requests arrive and leave between rounds; page lists
cover each round's K tokens (sometimes a spare page more). The trace keeps every request's true
K/V, so `oracle` gives the exact attention of step j of a round.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from mstar_attn import AttentionSpec, StepBatch
from mstar_attn.metadata.draft import DraftRound, build_round
from tests.support.exact import TrueKV, exact_attention


@attrs.define
class _Request:
    cached: int  # verified tokens in the cache
    pages: list = attrs.Factory(list)
    truth: TrueKV = attrs.Factory(TrueKV)  # its true K / V (on the trace's device)


class DraftTrace:
    """round(k) -> DraftRound; new_kv(k) / query(k) -> the round's inputs [B, K, heads, head_dim];
    oracle(plan, q_j, g): exact attention of one step of layer group g; verify(caches) ends the round."""

    def __init__(self, spec: AttentionSpec, seed: int, device="cpu", max_batch: int = 16, max_context: int = 300):
        self.spec, self.device, self.max_batch, self.max_context = spec, device, max_batch, max_context
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = [int(p) for p in self.rng.permutation(spec.num_pages)]
        self.live: list[_Request] = []
        self.poisoned = 0  # stale slots overwritten with large values after verification
        # the layers' attention sinks where a group has them (LayerGroup.sinks): N(0, 3^2) per head, float32,
        # on the device: some heads' sinks take most of the softmax, others almost none
        has = any(g.sinks for g in spec.groups)
        self.sinks = (3 * torch.randn(spec.num_qo_heads, generator=self.gen)).to(device) if has else None
        self._prompts: list[_Request] = []  # arrivals whose prompt K/V write_prompts has still to write

    def round(self, k: int) -> DraftRound:
        ps = self.spec.page_size
        keep = [r for r in self.live if r.cached < self.max_context or self._leave(r)]
        small = int(self.rng.integers(1, min(8, self.max_batch) + 1))  # half the rounds at most 8 requests
        target = small if self.rng.random() < 0.5 else int(self.rng.integers(small, self.max_batch + 1))
        while len(keep) > target:  # some leave early
            self._leave(keep.pop(int(self.rng.integers(len(keep)))))
        while len(keep) < target:
            n = int(self.rng.choice([1, ps, ps + 1, int(self.rng.integers(1, self.max_context))]))
            r = _Request(n, truth=TrueKV(self.device))  # a prompt already in the cache (random K/V written through the pages)
            shape = (n, self.spec.num_kv_heads, self.spec.head_dim)  # (the truth: values the cache's dtype holds)
            r.truth.append(*(torch.randn(shape, generator=self.gen).to(self.spec.dtype) for _ in range(2)))
            r.pages = [self.free.pop() for _ in range(-(-n // ps))]
            self._prompts.append(r)
            keep.append(r)
        self.live = keep
        for r in self.live:  # pages for the round's k tokens, sometimes one spare
            need = -(-(r.cached + k) // ps) + int(self.rng.random() < 0.2)
            r.pages += [self.free.pop() for _ in range(max(need - len(r.pages), 0))]
        batch = StepBatch.from_pages(np.ones(len(self.live), np.int32), [r.cached + 1 for r in self.live],
                                     [r.pages for r in self.live], ps)
        return build_round(batch, self.spec, k)

    def write_prompts(self, caches) -> None:
        """Write the new requests' prompt K/V into every cache (straight through the flat slots)."""
        ps = self.spec.page_size
        for r in self._prompts:
            slots = torch.tensor([r.pages[t // ps] * ps + t % ps for t in range(r.cached)])
            k, v = r.truth.kv()
            for c in caches:
                kf, vf = c.flat()
                kf[slots.to(kf.device)] = k.to(device=kf.device, dtype=c.k.dtype)
                vf[slots.to(vf.device)] = v.to(device=vf.device, dtype=c.v.dtype)
        self._prompts = []

    def new_kv(self, k: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K, V [B, k, kv_heads, head_dim] for the round's tokens (spec dtype, on the device), kept as the truth."""
        shape = (len(self.live), k, self.spec.num_kv_heads, self.spec.head_dim)
        kk, vv = (torch.randn(shape, generator=self.gen).to(dtype or self.spec.dtype) for _ in range(2))
        for i, r in enumerate(self.live):
            r.truth.append(kk[i], vv[i])
        return kk.to(self.device), vv.to(self.device)

    def query(self, k: int, dtype=None) -> torch.Tensor:
        shape = (len(self.live), k, self.spec.num_qo_heads, self.spec.head_dim)
        return torch.randn(shape, generator=self.gen).to(dtype or self.spec.dtype).to(self.device)

    def oracle(self, plan, q: torch.Tensor, group: int) -> torch.Tensor:
        """Exact attention [B, qo_heads, head_dim] float64 (on the trace's device) of draft step
        plan.draft_step for layer group `group`, q [B, qo_heads, head_dim]: request i's query over its
        first kv_lens[i] true keys, with the group's window and sinks (support.exact)."""
        g, spec = self.spec.groups[group], self.spec
        out = torch.empty(q.shape, dtype=torch.float64, device=self.device)
        for i, r in enumerate(self.live):
            n = r.cached + 1 + plan.draft_step  # (the trace's own count, not the plan under test)
            k, v = r.truth.kv(n)
            out[i] = exact_attention(q[i : i + 1], k, v, scale=spec.sm_scale, soft_cap=spec.soft_cap,
                                     window=g.window or 0, sinks=self.sinks if g.sinks else None)[0]
        return out

    def verify(self, k: int, caches) -> None:
        """The target kept 1..k of each request's drafted positions: truncate the truth, and overwrite the
        stale slots past the kept length (inside the request's pages) with large values in every cache."""
        ps = self.spec.page_size
        for r in self.live:
            start = r.cached
            r.cached += int(self.rng.integers(1, k + 1))
            r.truth.truncate(r.cached)
            stale = [r.pages[t // ps] * ps + t % ps for t in range(r.cached, start + k)]
            if stale:
                self.poisoned += len(stale)
                for c in caches:
                    kf, vf = c.flat()
                    idx = torch.tensor(stale, device=kf.device)
                    kf[idx] = 30 * torch.randn(len(stale), *kf.shape[1:], generator=self.gen).to(kf.dtype).to(kf.device)
                    vf[idx] = 30 * torch.randn(len(stale), *vf.shape[1:], generator=self.gen).to(vf.dtype).to(vf.device)

    def _leave(self, r: _Request) -> bool:
        self.free += r.pages
        return False


def round_layers(backend, caches, steps, x: dict, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """All K steps of a round, each one layer per group through `backend` (write_kv then run):
    x["q"] [rows, K, qo_heads, d], x["k"], x["v"] [rows, K, kv_heads, d]; returns [rows, K, groups, qo_heads, d].
    sinks: [qo_heads] float32, passed to the groups that have sinks."""
    outs = []
    for j, step in enumerate(steps):
        q, k, v = (x[name][:, j].contiguous() for name in ("q", "k", "v"))
        outs.append(torch.stack([_layer(backend, step, (q, k, v), c, g, sinks) for g, c in enumerate(caches)], dim=1))
    return torch.stack(outs, dim=1)


def _layer(backend, step, qkv, cache, g, sinks):
    q, k, v = qkv
    backend.write_kv(step, k, v, cache)
    return backend.run(step, q, cache, group=g, sinks=sinks if step.plan.spec.groups[g].sinks else None)


def serve_rounds(trace: DraftTrace, pool, backend, caches, ks, seed: int, graphs=None) -> dict:
    """One round per k in `ks`, committed with commit_round and run through `backend`: every step's
    output of every group, per request, within the dtype's bounds of the exact attention. With
    `graphs` (a RoundGraphs of round_layers) a captured round replays, and equals an eager call bit
    for bit. Returns rounds run by (k, replayed)."""
    from tests.helpers import assert_close_per_request, replay_or_run

    ran: dict = {}
    for i, k in enumerate(ks):
        draft = trace.round(k)
        trace.write_prompts(caches)
        steps = pool.commit_round(draft)
        kk, vv = trace.new_kv(k)
        x = {"q": trace.query(k), "k": kk, "v": vv}
        out, replay = replay_or_run(graphs, steps, x, lambda s, x: round_layers(backend, caches, s, x, trace.sinks),
                                    (f"seed {seed}", i, k))
        for j, plan in enumerate(draft.steps):
            for g in range(len(caches)):
                want = trace.oracle(plan, x["q"][:, j], g)
                assert_close_per_request(out[: plan.batch_size, j, g], want, plan, trace.spec.dtype,
                                         (f"seed {seed}", f"round {i}", f"k {k}", f"step {j}", f"group {g}"))
        trace.verify(k, caches)
        ran[(k, replay)] = ran.get((k, replay), 0) + 1
    return ran


def gpu_rounds(backend, name: str, seed: int, page_size: int = 16, rounds_per_k: int = 3, sinks: bool = False) -> dict:
    """Rounds of K = 1..8 on the GPU through `backend` (a kernels module named `name`): 32 / 8 heads
    of 128, a full group and a window of 40 (both with attention sinks where `sinks`); rounds of buckets
    1, 4 and 8 replay one graph of all K steps (every step's write_kv + run of both groups), larger
    rounds run eagerly (see serve_rounds)."""
    from mstar_attn import LayerGroup
    from mstar_attn.capture.graphs import RoundGraphs
    from tests.helpers import gpu_pool, random_cache

    torch.manual_seed(seed)
    groups = (LayerGroup(sinks=sinks), LayerGroup("window", window=40, sinks=sinks))
    spec = AttentionSpec(32, 8, 128, page_size, 30000, groups=groups, layer_groups=(0, 1), backend=name)
    trace = DraftTrace(spec, seed, device="cuda", max_batch=24, max_context=400)
    pool = gpu_pool(spec, buckets=(1, 4, 8), max_pages_per_request=500, max_draft_steps=8)
    caches = [random_cache(spec, seed + g) for g in range(2)]
    K = 8

    def static(k):
        return {"q": torch.zeros(8, k, 32, 128, device="cuda", dtype=spec.dtype),
                "k": torch.zeros(8, k, 8, 128, device="cuda", dtype=spec.dtype),
                "v": torch.zeros(8, k, 8, 128, device="cuda", dtype=spec.dtype)}

    graphs = {k: RoundGraphs(pool, lambda steps, x: round_layers(backend, caches, steps, x, trace.sinks), static(k))
              for k in range(1, K + 1)}
    for k, g in graphs.items():
        g.capture(k)
    ran: dict = {}
    order = [k for k in range(1, K + 1) for _ in range(rounds_per_k)]
    trace.rng.shuffle(order)
    for k in order:
        for key, n in serve_rounds(trace, pool, backend, caches, [k], seed, graphs[k]).items():
            ran[key] = ran.get(key, 0) + n
    assert trace.poisoned > 0, f"seed {seed}"
    return ran
