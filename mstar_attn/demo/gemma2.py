"""The model adapter for transformers' Gemma 2: interleaved sliding-window and full layers, logit
soft-capping, a non-default attention scale. Same surface as `llama.py`, plus `spec_fields`:

    build_model(cfg, dtype, device) -> model      the stock HF model, also the oracle `check` runs
    spec_fields(model) -> dict                     AttentionSpec's groups, layer_groups, sm_scale, soft_cap
    forward(model, ctx, layers, ids, positions) -> logits [R, vocab]

The window layers form a layer group with its own page list (LayerGroup.own_pages): the engine frees
the window pages a request has moved past, so those layers hold about window / page_size + 1 pages
per request however long it grows.
"""

from __future__ import annotations

import torch

from mstar_attn import Attention, LayerGroup
from mstar_attn.demo.config import DemoConfig, DemoError, seeded_model, transformers_classes

ATTN_SOFT_CAP = 2.0  # below HF's default 50 so that it bends this small random model's attention logits
FINAL_SOFT_CAP = 30.0


def build_model(cfg: DemoConfig, dtype: torch.dtype, device: torch.device):
    """A random Gemma2ForCausalLM (eager attention: plain math, sliding-window masks), seeded, nothing downloaded.
    Layers alternate sliding-window (cfg.window tokens) and full attention, as in Gemma 2."""
    Gemma2Config, Gemma2ForCausalLM = transformers_classes("Gemma2Config", "Gemma2ForCausalLM")
    if cfg.hidden % (2 * cfg.heads):
        raise DemoError(f"--hidden {cfg.hidden} must be a multiple of 2 x {cfg.heads} query heads (RoPE needs even head dims)")
    head_dim = cfg.hidden // cfg.heads
    hf = Gemma2Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 2, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=head_dim,
        query_pre_attn_scalar=2 * head_dim, sliding_window=cfg.window, attn_logit_softcapping=ATTN_SOFT_CAP,
        final_logit_softcapping=FINAL_SOFT_CAP, max_position_embeddings=1024, initializer_range=cfg.init_std,
    )
    return seeded_model(lambda: Gemma2ForCausalLM(hf), cfg.seed, dtype, device)


def spec_fields(model) -> dict:
    """Group 0: the full layers, on the shared page list; group 1: the sliding-window layers, on their own."""
    c = model.config
    window = LayerGroup("window", window=c.sliding_window, own_pages=True)
    return dict(groups=(LayerGroup(), window), layer_groups=tuple(int(t == "sliding_attention") for t in c.layer_types),
                sm_scale=c.query_pre_attn_scalar**-0.5, soft_cap=c.attn_logit_softcapping)


def forward(model, ctx, layers: list[Attention], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One engine step through the HF modules (see llama.forward): each layer writes and reads its
    group's pages. ids, positions: [R] int64 on the model's device. Returns logits [R, vocab], soft-capped."""
    from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb

    m, spec, R = model.model, layers[0].spec, ids.shape[0]
    h = m.embed_tokens(ids)  # [R, hidden], scaled by sqrt(hidden) inside
    cos, sin = (t[0] for t in m.rotary_emb(h[None], positions[None]))  # [R, head_dim]
    heads = lambda x: x.view(R, -1, spec.head_dim)  # noqa: E731  [R, H * D] -> [R, H, D]
    for i, layer in enumerate(m.layers):
        sa, x = layer.self_attn, layer.input_layernorm(h)
        q, k = apply_rotary_pos_emb(heads(sa.q_proj(x)), heads(sa.k_proj(x)), cos, sin, unsqueeze_dim=1)
        v = heads(sa.v_proj(x))
        out = sa.o_proj(layers[i].forward(q, k, v, ctx).reshape(R, -1))  # (the layer knows its group)
        h = h + layer.post_attention_layernorm(out)
        h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    logits = model.lm_head(m.norm(h))
    cap = model.config.final_logit_softcapping
    return logits if not cap else torch.tanh(logits / cap) * cap
