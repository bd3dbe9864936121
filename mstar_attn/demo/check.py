"""The check against transformers: the stock model recomputes every logit the engine computed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from mstar_attn.demo.engine import Request

# Logit tolerance |engine - oracle| <= REL * max|oracle logit| + ABS, per request. Both sides run the
# same weights on the same tokens; they differ only in summation order (the reference backend does
# one einsum per request in float32, HF eager one batched matmul with an additive mask; the linear
# layers see T step rows here, N sequence rows there). float32: each op is off by ~sqrt(K)*2^-24,
# and the logits end up ~1e-6 relative apart (measured: <= 1.3e-6 over seeds 0-4, 4 and 8 layers),
# so 1e-3 leaves ~800x headroom while a wrong attention (wrong key, position or row) moves logits
# by percents of their scale (scaling every attention output by 0.98 already fails it ~20x over).
# bf16/fp16: both sides round every op's output to the dtype (eps 2^-8 resp. 2^-11) at different
# points (the reference attends in float32, eager rounds the softmax probabilities to the dtype),
# and the roundings compound through the residual stream: measured <= 2.3e-2 (bf16, ~6 eps) and
# <= 2.9e-3 (fp16, ~6 eps) relative; the bounds below leave ~2-3x over that for other backends.
REL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
ABS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@attrs.frozen
class Check:
    """One request against the oracle. err: max |logit diff|; tol: its bound; tokens_checked: greedy
    tokens compared (bf16/fp16 stop at the oracle's first near-tie); token_mismatches among them."""

    rid: int
    err: float
    tol: float
    tokens_checked: int
    token_mismatches: int

    @property
    def ok(self) -> bool:
        return self.err <= self.tol and self.token_mismatches == 0


def decoder_logits(model, req: Request) -> torch.Tensor:
    """A decoder-only model's logits [len(tokens) - 1, vocab] on prompt + generated tokens but the last."""
    return model(torch.tensor([req.tokens[:-1]], device=model.device)).logits[0]


def check_request(model, req: Request, dtype: torch.dtype, logits_of=decoder_logits) -> Check:
    """Teacher-forced: the stock model on prompt + generated tokens (logits_of(model, req); an
    encoder-decoder's also sees the encoder input), at every position the engine computed."""
    want = logits_of(model, req)[req.shared :].float().cpu()  # [n, vocab]
    got = torch.cat(req.logits)
    tol = REL[dtype] * want.abs().max().item() + ABS[dtype]
    err = (got - want).abs().max().item()
    gen = want[len(req.prompt) - 1 - req.shared :]  # rows whose argmax is a generated token
    top2 = gen.topk(2, dim=-1).values
    checked = mismatches = 0
    for row, tok, (a, b) in zip(gen, req.tokens[len(req.prompt) :], top2.tolist()):
        if dtype != torch.float32 and a - b < tol:
            break  # a near-tie: either token is right within the dtype's precision
        checked += 1
        mismatches += int(row.argmax().item() != tok)
    return Check(req.rid, err, tol, checked, mismatches)
