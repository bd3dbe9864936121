"""The model adapter for transformers' BART, an encoder-decoder: the encoder runs once per request
through the dense path (no KV cache, non-causal), its output's cross K/V go into each decoder
layer's cross-attention cache once (the request's first step), and every decoder step reads them
through a Kind.CROSS layer group beside the causal self-attention group.

    build_model(cfg, dtype, device) -> model
    spec_fields(model) -> dict        groups (self, cross), layer_groups: self and cross per decoder layer
    make_trace(cfg, rng) -> requests  encoder inputs of different lengths, short decoder prompts
    encode(model, ctx, layers, inputs, dense_backend)   the encoder, and the cross K/V stored
    forward(model, ctx, layers, ids, positions) -> logits [R, vocab]   the decoder step
    logits_of(model, req) -> [n, vocab]   the stock model's logits, the oracle

layers: one Attention per attention layer of the decoder, in spec.layer_groups order: layer i's self
attention at 2i, its cross attention at 2i + 1.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar_attn import Attention, LayerGroup
from mstar_attn.demo.config import DemoConfig, DemoError, seeded_model, transformers_classes
from mstar_attn.demo.engine import Request
from mstar_attn.dense import DenseAttention, DenseHeads, build_dense_plan

DECODER_START = 2


def build_model(cfg: DemoConfig, dtype: torch.dtype, device: torch.device):
    """A random BartForConditionalGeneration (eager attention), seeded, nothing downloaded:
    cfg.layers encoder and decoder layers, cfg.heads heads (BART's are multi-head: kv_heads = heads)."""
    BartConfig, BartForConditionalGeneration = transformers_classes("BartConfig", "BartForConditionalGeneration")
    if cfg.hidden % cfg.heads:
        raise DemoError(f"--hidden {cfg.hidden} must be a multiple of {cfg.heads} heads")
    hf = BartConfig(
        vocab_size=cfg.vocab, d_model=cfg.hidden, encoder_layers=cfg.layers, decoder_layers=cfg.layers,
        encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads, encoder_ffn_dim=2 * cfg.hidden,
        decoder_ffn_dim=2 * cfg.hidden, max_position_embeddings=256, init_std=cfg.init_std,
        pad_token_id=1, bos_token_id=0, eos_token_id=DECODER_START, decoder_start_token_id=DECODER_START,
    )

    def random_bias(model):  # (zeros after init: a random bias checks it is added)
        model.final_logits_bias.normal_(0, 0.1)

    return seeded_model(lambda: BartForConditionalGeneration(hf), cfg.seed, dtype, device, random_bias)


def spec_fields(model) -> dict:
    c = model.config
    return dict(groups=(LayerGroup(), LayerGroup("cross")), layer_groups=(0, 1) * c.decoder_layers,
                num_kv_heads=c.decoder_attention_heads)


def make_trace(cfg: DemoConfig, rng: np.random.Generator) -> list[Request]:
    """Requests 0 and 1 at step 0, then one every 1-3 steps; encoder inputs of 1-48 tokens; decoder
    prompts of the start token and 0-2 more; each request generates 3-14 tokens."""
    reqs, step = [], 0
    for i in range(cfg.requests):
        step += 0 if i < 2 else int(rng.integers(1, 4))
        prompt = [DECODER_START] + rng.integers(3, cfg.vocab, int(rng.integers(0, 3))).tolist()
        r = Request(i, step, prompt, int(rng.integers(3, 15)))
        r.encoder = rng.integers(3, cfg.vocab, int(rng.integers(1, 49))).tolist()
        reqs.append(r)
    return reqs


def _positions(emb, pos: torch.Tensor) -> torch.Tensor:
    return F.embedding(pos + emb.offset, emb.weight)  # BART's learned positions sit 2 rows in


def encode(model, ctx, layers: list[Attention], inputs: list[list[int]], backend: str) -> None:
    """Run the encoder over `inputs` (the requests storing their encoder this step, in plan order)
    as one packed dense batch, and store each decoder layer's cross K/V (its cross Attention's store)."""
    if not inputs:
        return
    enc, spec, device = model.model.encoder, layers[0].spec, model.device
    lens = [len(x) for x in inputs]
    ids = torch.tensor([t for x in inputs for t in x], device=device)
    pos = torch.tensor([p for n in lens for p in range(n)], device=device)
    h = enc.layernorm_embedding(enc.embed_tokens(ids) + _positions(enc.embed_positions, pos))
    H, D = spec.num_qo_heads, spec.head_dim
    dense = DenseAttention(build_dense_plan(lens, DenseHeads(H, H, D), causal=False, dtype=spec.dtype, backend=backend), device)
    heads = lambda x: x.view(-1, H, D)  # noqa: E731
    for layer in enc.layers:
        sa = layer.self_attn
        out = dense(heads(sa.q_proj(h)), heads(sa.k_proj(h)), heads(sa.v_proj(h))).reshape(h.shape)
        h = layer.self_attn_layer_norm(h + sa.out_proj(out))
        h = layer.final_layer_norm(h + layer.fc2(layer.activation_fn(layer.fc1(h))))
    for i, layer in enumerate(model.model.decoder.layers):
        ca = layer.encoder_attn
        layers[2 * i + 1].store(heads(ca.k_proj(h)), heads(ca.v_proj(h)), ctx)


def forward(model, ctx, layers: list[Attention], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decoder step: self attention (layer 2i, group 0: forward stores and attends) and cross attention
    (layer 2i + 1, group 1: attend over the encoder K/V stored at each request's first step). ids, positions
    [R] int64; logits [R, vocab]."""
    dec, spec, R = model.model.decoder, layers[0].spec, ids.shape[0]
    heads = lambda x: x.view(R, -1, spec.head_dim)  # noqa: E731
    h = dec.layernorm_embedding(dec.embed_tokens(ids) + _positions(dec.embed_positions, positions))
    for i, layer in enumerate(dec.layers):
        sa, ca = layer.self_attn, layer.encoder_attn
        k, v = heads(sa.k_proj(h)), heads(sa.v_proj(h))
        out = layers[2 * i].forward(heads(sa.q_proj(h)), k, v, ctx).reshape(R, -1)
        h = layer.self_attn_layer_norm(h + sa.out_proj(out))
        out = layers[2 * i + 1].attend(heads(ca.q_proj(h)), ctx).reshape(R, -1)
        h = layer.encoder_attn_layer_norm(h + ca.out_proj(out))
        h = layer.final_layer_norm(h + layer.fc2(layer.activation_fn(layer.fc1(h))))
    return model.lm_head(h) + model.final_logits_bias


def logits_of(model, req: Request) -> torch.Tensor:
    """The stock model, teacher-forced: [len(tokens) - 1, vocab] for the decoder tokens but the last."""
    enc = torch.tensor([req.encoder], device=model.device)
    dec = torch.tensor([req.tokens[:-1]], device=model.device)
    return model(input_ids=enc, decoder_input_ids=dec).logits[0]
