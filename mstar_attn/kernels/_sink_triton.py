"""The attention-sink epilogue as one fused Triton kernel, for CUDA tensors.

out[t, h, :] = o[t, h, :] * sigmoid(lse[t, h] * lse_scale - sinks[h]), computed in float32 and rounded
once to o's dtype: the same math as _common.with_sinks' torch path, in one launch instead of six
(inside a captured graph each launch costs its own node). Triton is imported on first use (it ships
with CUDA builds of torch); `available()` says whether it can serve the tensors, and `apply` falls back
to the torch path (returns None) where the kernel cannot run: its first launch on a device, dtype and
head dim made inside a CUDA graph capture (loading a compiled module is not allowed there: warm up
first, as DecodeGraphs, RoundGraphs and mstar_attn.warmup do), or a launch that failed before (a
Triton that imports but cannot compile here: warned once). ENABLED = False turns the kernel off.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

ENABLED = True
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TOKENS = 16  # tokens per program (the kernel's literal 16): one head, 16 x head_dim elements


@functools.cache
def _kernel():
    """The compiled-on-first-use Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # (ImportError, or a Triton install that cannot load here)
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


_launched: set = set()  # (device, dtype, head dim, 16-byte alignments) keys whose kernel has run
_failed: set = set()  # keys whose launch raised: served by the torch path from then on


def launch_key(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple:
    """What a compiled kernel is specialized on: device, dtype, head dim, each pointer's 16-byte alignment."""
    return (o.device, o.dtype, o.shape[2], *(t.data_ptr() % 16 == 0 for t in (o, lse, sinks)))


def available(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> bool:
    """Whether the fused kernel can serve these tensors: CUDA, all on one device, o [T, H, D] 16-bit or
    float32 contiguous, lse [T, H] float32 contiguous, sinks [H] float32, fewer than 2^31 elements (the
    kernel's offsets are int32), Triton imports and ENABLED."""
    return (ENABLED and o.is_cuda and o.dim() == 3 and o.dtype in _DTYPES and o.numel() < 2**31
            and lse.dtype == torch.float32 and sinks.dtype == torch.float32
            and tuple(lse.shape) == tuple(o.shape[:2]) and tuple(sinks.shape) == (o.shape[1],)
            and lse.device == o.device and sinks.device == o.device
            and o.is_contiguous() and lse.is_contiguous() and sinks.is_contiguous() and _kernel() is not None)


def apply(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, lse_scale: float) -> torch.Tensor | None:
    """o [T, H, D], lse [T, H] float32, sinks [H] float32, all on one CUDA device (available() holds) ->
    a new [T, H, D] tensor of o's dtype: o * sigmoid(lse * lse_scale - sinks); None where the kernel
    cannot run (see the module doc: the caller takes the torch path). Graph-capturable once the kernel
    has run for this device, dtype and head dim."""
    triton, kernel = _kernel()
    key = launch_key(o, lse, sinks)
    if key in _failed or (key not in _launched and o.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    out = torch.empty_like(o)
    tokens, heads, d = o.shape
    if not (tokens and heads):
        return out
    try:
        with torch.cuda.device(o.device) if o.is_cuda else contextlib.nullcontext():  # (CPU: the interpreter)
            kernel[(triton.cdiv(tokens, _TOKENS), heads)](o, lse, sinks, out, tokens, float(lse_scale), D=d,
                                                           BLOCK_D=triton.next_power_of_2(d))
    except Exception as e:  # (Triton imports but cannot build or launch here: the torch path serves)
        if key in _launched:
            raise
        _failed.add(key)
        warnings.warn(f"mstar_attn: the fused sink kernel failed for {key} ({type(e).__name__}: {e}); "
                      "attention sinks take the torch path", RuntimeWarning, stacklevel=3)
        return None
    _launched.add(key)
    return out
