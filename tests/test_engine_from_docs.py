"""A Qwen2-class engine written from the README and docs/engine-guide.md alone (CPU, reference backend).

Continuous batching over the pool's page table (StepRows): requests arrive at different steps, their
prompts are prefilled in chunks beside other requests' decode steps, finished requests give their
table rows and pages back and later ones reuse them. Every layer calls `Attention.forward(q, k, v,
step)`; RoPE reads `plan.positions`, each request's rows are `plan.qo_indptr[i]:qo_indptr[i + 1]`.
Every logit row the engine computes is compared, per request, against transformers' own forward over
the same tokens (float32 on both sides: the bound is float32 roundoff over a few layers' sums).
Only names the README and the engine guide show are imported from mstar_attn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_attn import Attention, AttentionSpec, GraphBufferPool, PoolLimits, StepRows, build_plan
from tests.helpers import fresh_seed

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb  # noqa: E402

PAGE = 4


def qwen2(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.Qwen2ForCausalLM(cfg).eval()


class Engine:
    """What an engine team writes from the docs: a spec, a pool with a page table, one Attention per
    layer, and a forward that feeds RoPE from the plan."""

    def __init__(self, model, num_pages: int):
        cfg = model.config
        self.model, self.heads = model, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
        H, KV, D = self.heads
        self.spec = AttentionSpec(num_qo_heads=H, num_kv_heads=KV, head_dim=D, page_size=PAGE, num_pages=num_pages,
                                  dtype=torch.float32, backend="reference")
        self.pool = GraphBufferPool(self.spec, PoolLimits(max_batch_size=8, max_num_tokens=64, max_num_pages=num_pages,
                                                          max_requests=8, max_pages_per_request=32), device="cpu")
        self.layers = Attention.for_model(self.spec, "cpu", num_layers=cfg.num_hidden_layers)

    def forward(self, step, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one committed step's tokens ids [T]."""
        m, (H, KV, D) = self.model.model, self.heads
        T = ids.shape[0]
        positions = torch.tensor(step.plan.positions)
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h[None], positions[None])
        for layer, attn in zip(m.layers, self.layers):
            x = layer.input_layernorm(h)
            sa = layer.self_attn
            q = sa.q_proj(x).view(1, T, H, D).transpose(1, 2)
            k = sa.k_proj(x).view(1, T, KV, D).transpose(1, 2)
            v = sa.v_proj(x).view(T, KV, D)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out = attn.forward(q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), v, step)
            h = h + sa.o_proj(out.reshape(T, H * D))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))


def test_a_qwen2_engine_from_the_docs_matches_transformers_per_request():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = qwen2(seed)
    eng = Engine(model, num_pages=40)
    table, chunk = eng.pool.table, 7
    # (arrival step, prompt): more requests than rows, so later ones take finished requests' rows and pages
    reqs = [{"arrival": int(a), "tokens": rng.integers(0, 97, int(n)).tolist(), "prompt": int(n), "new": int(g),
             "done_at": 0, "logits": []}
            for a, n, g in zip(sorted(rng.integers(0, 12, 11)), rng.integers(3, 30, 11), rng.integers(1, 6, 11))]
    free_pages, free_rows = list(range(40)), list(range(8))
    waiting, running, step_no, reused, used = list(reqs), [], 0, 0, set()
    with torch.inference_mode():
        while waiting or running:
            reserved = sum(-(-(q["prompt"] + q["new"]) // PAGE) - q["pages"] for q in running)
            while waiting and waiting[0]["arrival"] <= step_no and free_rows and \
                    len(free_pages) - reserved >= -(-(waiting[0]["prompt"] + waiting[0]["new"]) // PAGE):
                r = waiting.pop(0)  # (admitted with pages for its whole sequence set aside)
                r["row"], r["cached"], r["pages"] = free_rows.pop(), 0, 0
                reserved += -(-(r["prompt"] + r["new"]) // PAGE)
                running.append(r)
            if not running:
                step_no += 1
                continue
            q_lens = [min(chunk, len(r["tokens"]) - r["cached"]) for r in running]
            kv_lens = [r["cached"] + q for r, q in zip(running, q_lens)]
            for r, kv in zip(running, kv_lens):  # pages for the tokens this step writes
                need = -(-kv // PAGE) - r["pages"]
                if need > 0:
                    pages = [free_pages.pop(0) for _ in range(need)]
                    reused += sum(p in used for p in pages)
                    used.update(pages)
                    table.assign(r["row"], pages)
                    r["pages"] += need
            plan = build_plan(StepRows(rows=[r["row"] for r in running], q_lens=q_lens, kv_lens=kv_lens), eng.spec)
            step = eng.pool.commit(plan, defer=True)
            ids = torch.tensor([t for r, q in zip(running, q_lens) for t in r["tokens"][r["cached"] : r["cached"] + q]])
            logits = eng.forward(step, ids)
            for i, (r, q) in enumerate(zip(running, q_lens)):
                rows = logits[plan.qo_indptr[i] : plan.qo_indptr[i + 1]]
                r["logits"].append(rows)
                r["cached"] += q
                if r["cached"] == len(r["tokens"]):  # its last token's logits: the next token (greedy)
                    r["tokens"].append(int(rows[-1].argmax()))
            for r in [r for r in running if len(r["tokens"]) - r["prompt"] >= r["new"] and r["cached"] == len(r["tokens"]) - 1]:
                running.remove(r)
                free_pages[:0] = table.release(r["row"]).tolist()  # (its pages are the next ones handed out)
                free_rows.append(r["row"])
            step_no += 1
    assert all(len(r["tokens"]) == r["prompt"] + r["new"] for r in reqs), seed
    assert len(free_pages) == 40 and sorted(free_rows) == list(range(8)) and reused > 0, (seed, reused)
    for i, r in enumerate(reqs):  # per request: every row the engine computed against transformers' forward
        ours = torch.cat(r["logits"])
        with torch.inference_mode():
            want = model(torch.tensor([r["tokens"][: ours.shape[0]]])).logits[0]
        err = (ours - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), (f"seed {seed}", f"request {i}", err)
