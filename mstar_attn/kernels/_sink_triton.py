"""The attention-sink epilogue as one fused Triton kernel, for CUDA tensors.

out[t, h, :] = o[t, h, :] * sigmoid(lse[t, h] * lse_scale - sinks[h]), computed in float32 and rounded
once to o's dtype: the same math as _common.with_sinks' torch path, in one launch instead of six
(inside a captured graph each launch costs its own node). Triton is imported on first use (it ships
with CUDA builds of torch); `available()` says whether it can serve a tensor.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TOKENS = 16  # tokens per program (the kernel's literal 16): one head, 16 x head_dim elements


@functools.cache
def _kernel():
    """The compiled-on-first-use Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["tokens"])
    def sink_epilogue(o_ptr, lse_ptr, sink_ptr, out_ptr, tokens, lse_scale, D: tl.constexpr, BLOCK_D: tl.constexpr):
        # grid (token blocks of 16, heads): o, out [tokens, heads, D], lse [tokens, heads], sinks [heads]
        head, heads = tl.program_id(1), tl.num_programs(1)
        t = tl.program_id(0) * 16 + tl.arange(0, 16)
        cols = tl.arange(0, BLOCK_D)
        live = t < tokens
        lse = tl.load(lse_ptr + t * heads + head, mask=live, other=0.0).to(tl.float32)
        keep = tl.sigmoid(lse * lse_scale - tl.load(sink_ptr + head).to(tl.float32))
        at = (t * heads + head)[:, None] * D + cols[None, :]
        mask = live[:, None] & (cols[None, :] < D)
        x = tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (x * keep[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    return triton, sink_epilogue


def available(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> bool:
    """Whether the fused kernel serves these tensors: CUDA, o [T, H, D] 16-bit or float32 contiguous,
    lse [T, H] float32 contiguous, sinks [H] float32, and Triton imports."""
    return (o.is_cuda and o.dtype in _DTYPES and lse.dtype == torch.float32 and sinks.dtype == torch.float32
            and o.dim() == 3 and o.is_contiguous() and lse.is_contiguous() and sinks.is_contiguous()
            and _kernel() is not None)


def apply(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, lse_scale: float) -> torch.Tensor:
    """o [T, H, D], lse [T, H] float32, sinks [H] float32, all on one CUDA device (available() holds) ->
    a new [T, H, D] tensor of o's dtype: o * sigmoid(lse * lse_scale - sinks). Graph-capturable once
    the kernel has compiled (its first call, made by every capture's warm-up)."""
    triton, kernel = _kernel()
    out = torch.empty_like(o)
    tokens, heads, d = o.shape
    if tokens and heads:
        kernel[(triton.cdiv(tokens, _TOKENS), heads)](o, lse, sinks, out, tokens, float(lse_scale), D=d,
                                                       BLOCK_D=triton.next_power_of_2(d))
    return out
