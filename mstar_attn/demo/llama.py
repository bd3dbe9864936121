"""The model adapter for transformers' Llama: the random model, and one step's forward through the seam.

Everything that knows the model is a transformers Llama is here (its config, modules and RoPE). A
second family (an encoder-decoder, a speculative-decoding draft model) is a sibling module with the
same surface, handed to the engine by `run.run_demo`:

    build_model(cfg, dtype, device) -> model      the stock HF model, also the oracle `check` runs
    spec_fields(model) -> dict                     the AttentionSpec fields the model decides
    forward(model, ctx, layers, ids, positions) -> logits [R, vocab]   layers: the model's Attention layers

`gemma2.py` is the second family (sliding-window layers on their own page lists).
"""

from __future__ import annotations

import torch

from mstar_attn import Attention
from mstar_attn.demo.config import DemoConfig, DemoError, seeded_model, transformers_classes


def build_model(cfg: DemoConfig, dtype: torch.dtype, device: torch.device):
    """A random LlamaForCausalLM (eager attention, so it is the plain-math oracle), seeded, nothing downloaded."""
    LlamaConfig, LlamaForCausalLM = transformers_classes("LlamaConfig", "LlamaForCausalLM")
    if cfg.hidden % (2 * cfg.heads):
        raise DemoError(f"--hidden {cfg.hidden} must be a multiple of 2 x {cfg.heads} query heads (RoPE needs even head dims)")
    hf = LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, max_position_embeddings=1024, initializer_range=cfg.init_std,
    )
    return seeded_model(lambda: LlamaForCausalLM(hf), cfg.seed, dtype, device)


def spec_fields(model) -> dict:
    """One layer group: every layer full causal attention, the default scale, no soft-cap."""
    return dict(layer_groups=(0,) * model.config.num_hidden_layers)


def forward(model, ctx, layers: list[Attention], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One engine step through the HF modules: the eager path, and the function decode graphs capture.

    ctx: the committed step (or the plan, on the reference seam); layers: the model's Attention layers.
    ids, positions: [R] int64 on the model's device, R = the seam's rows(ctx): the step's new tokens in plan
    row order, then bucket padding. Returns logits [R, vocab] in the model dtype. Launches kernels only:
    everything it reads is on the device (ctx's committed buffers, weights, caches, these inputs), and
    no host value in it changes between steps of one (slot, bucket), so it is graph-safe.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, spec, R = model.model, layers[0].spec, ids.shape[0]
    h = m.embed_tokens(ids)  # [R, hidden]
    cos, sin = (t[0] for t in m.rotary_emb(h[None], positions[None]))  # [R, head_dim]; HF wants a batch dim
    heads = lambda x: x.view(R, -1, spec.head_dim)  # noqa: E731  [R, H * D] -> [R, H, D]
    for i, layer in enumerate(m.layers):
        sa, x = layer.self_attn, layer.input_layernorm(h)
        q, k = apply_rotary_pos_emb(heads(sa.q_proj(x)), heads(sa.k_proj(x)), cos, sin, unsqueeze_dim=1)
        v = heads(sa.v_proj(x))
        h = h + sa.o_proj(layers[i].forward(q, k, v, ctx).reshape(R, -1))  # stores k, v, then attends
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))
