"""The model adapter for transformers' gpt-oss: attention sinks (a learned logit per query head in every
softmax denominator), alternating sliding-window and full layers, GQA, q/k/v biases, a mixture of
experts. Same surface as `gemma2.py`, plus `layer_sinks`:

    build_model(cfg, dtype, device) -> model      the stock HF model, also the oracle `check` runs
    spec_fields(model) -> dict                     groups (both with sinks), layer_groups
    layer_sinks(model) -> list[Tensor]             each layer's sinks, float32 [heads], for Attention(sinks=)
    forward(model, ctx, layers, ids, positions) -> logits [R, vocab]

transformers initializes the sinks near zero (std initializer_range), where dropping them would change
little; the demo draws them from N(SINK_MEAN, SINK_STD^2) instead, large enough that a run which drops
them fails its check (tests/demo/test_gpt_oss.py shows it does).
"""

from __future__ import annotations

import torch

from mstar_attn import Attention, LayerGroup
from mstar_attn.demo.config import DemoConfig, DemoError, seeded_model, transformers_classes

SINK_MEAN, SINK_STD = 1.0, 2.0  # the demo's sink logits per head (transformers' init: about N(0, 0.05^2))
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
# The router's bias per expert. Top-k routing is discontinuous: in bf16 the engine and the oracle round
# at different points, and a token whose k-th and (k+1)-th expert logits sit within that rounding picks
# a different expert on each side, which moves its logits by O(1) (measured: 1-4 of the CLI's 8 requests
# 5x over the tolerance at one position each, on the H100 with both GPU backends and on the CPU with the
# reference backend alike; gone with this spread). A spread far wider than the weights' part of the logits
# keeps every token off such ties: each token's top-2 are experts 0 and 1 (2 and 3 are never chosen),
# weighted by their logits (continuous), so the check sees attention errors and not routing flips. The
# weights' part of a router logit grows as about init_std * sqrt(hidden): the bias is scaled by
# sqrt(hidden / 512) past hidden 512 to keep the same margin.
ROUTER_BIAS = (6.0, 3.0, 0.0, -3.0)


def build_model(cfg: DemoConfig, dtype: torch.dtype, device: torch.device):
    """A random GptOssForCausalLM (eager attention), seeded, nothing downloaded: layers alternate sliding-window
    (cfg.window tokens) and full attention as in gpt-oss, EXPERTS experts of which EXPERTS_PER_TOKEN per token
    (the router's bias ROUTER_BIAS), sinks drawn from N(SINK_MEAN, SINK_STD^2)."""
    GptOssConfig, GptOssForCausalLM = transformers_classes("GptOssConfig", "GptOssForCausalLM")
    if cfg.hidden % (2 * cfg.heads):
        raise DemoError(f"--hidden {cfg.hidden} must be a multiple of 2 x {cfg.heads} query heads (RoPE needs even head dims)")
    hf = GptOssConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads,
        sliding_window=cfg.window, num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)],
        initializer_range=cfg.init_std,
    )

    def init(model):
        for layer in model.model.layers:
            with torch.no_grad():
                layer.self_attn.sinks.normal_(SINK_MEAN, SINK_STD)
                layer.mlp.router.bias.copy_(torch.tensor(ROUTER_BIAS) * max(1.0, (cfg.hidden / 512) ** 0.5))

    return seeded_model(lambda: GptOssForCausalLM(hf), cfg.seed, dtype, device, init)


def spec_fields(model) -> dict:
    """Group 0: the full layers, on the shared page list; group 1: the sliding-window layers, on their own;
    both with attention sinks."""
    c = model.config
    window = LayerGroup("window", window=c.sliding_window, own_pages=True, sinks=True)
    return dict(groups=(LayerGroup(sinks=True), window),
                layer_groups=tuple(int(t == "sliding_attention") for t in c.layer_types))


def layer_sinks(model) -> list[torch.Tensor]:
    """Each layer's sinks as the model holds them (its dtype's values), float32 [heads] on its device."""
    return [layer.self_attn.sinks.detach().float() for layer in model.model.layers]


def forward(model, ctx, layers: list[Attention], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One engine step through the HF modules (see llama.forward): each layer writes and reads its group's
    pages, its Attention holding its sinks. ids, positions: [R] int64 on the model's device. Returns logits
    [R, vocab]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    m, spec, R = model.model, layers[0].spec, ids.shape[0]
    h = m.embed_tokens(ids)  # [R, hidden]
    cos, sin = (t[0] for t in m.rotary_emb(h[None], positions[None]))
    heads = lambda x: x.view(R, -1, spec.head_dim)  # noqa: E731  [R, H * D] -> [R, H, D]
    for i, layer in enumerate(m.layers):
        sa, x = layer.self_attn, layer.input_layernorm(h)
        q, k = apply_rotary_pos_emb(heads(sa.q_proj(x)), heads(sa.k_proj(x)), cos, sin, unsqueeze_dim=1)
        v = heads(sa.v_proj(x))
        h = h + sa.o_proj(layers[i].forward(q, k, v, ctx).reshape(R, -1))  # (the layer knows its group and sinks)
        h = h + layer.mlp(layer.post_attention_layernorm(h)[None])[0][0]  # (experts: [1, R, hidden] -> [R, hidden])
    return model.lm_head(m.norm(h))
