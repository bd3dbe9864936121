"""A token-tree verify step's attention mask in FlashInfer's custom-mask layout, built on the device.

For request r with q_r new tokens (its tree, metadata/tree.py) and kv_r keys (its cached prefix of
kv_r - q_r tokens, then the new tokens), FlashInfer reads a [q_r, kv_r] row-major bit matrix: bit
(j, c) set where token j attends to key c, i.e. c is in the prefix, or c = prefix + i with token i
an ancestor of token j or j itself (bit i of the token's ancestor set, DraftTree.masks). Packed
little-endian (bit b of a segment in byte b // 8 at bit b % 8), each request's segment starting on a
byte: `byte_indptr` [R+1] int32 (request r's bytes: byte_indptr[r] .. byte_indptr[r+1]), or any offsets
at least that far apart (the bytes between a segment and the next are zero).

`pack` builds it in one Triton launch from the step's device arrays (O(total bytes), no host
round-trip); `host_mask` is the same mask from host arrays in numpy (a pure function: the oracle of
the kernel's tests, and the fallback where Triton does not run). Triton is imported on first use.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

BLOCK = 256  # bytes (packed) or bits (unpacked) per program


def byte_indptr(q_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """[R+1] int32: where each request's packed segment starts (ceil(q * kv / 8) bytes each); q_lens, kv_lens [R]."""
    out = np.zeros(q_lens.shape[0] + 1, np.int64)
    np.cumsum((q_lens.astype(np.int64) * kv_lens + 7) // 8, out=out[1:])
    return out.astype(np.int32)


def host_mask(q_lens: np.ndarray, kv_lens: np.ndarray, tree_bits: np.ndarray, packed: bool = True,
              offsets: np.ndarray | None = None) -> np.ndarray:
    """The mask from host arrays: q_lens, kv_lens [R] int, tree_bits [sum q] uint64 (token j's ancestor set
    over its request's tokens). packed: uint8 [byte_indptr[-1]] (FlashInfer's packed_custom_mask), else
    bool [sum q * kv] (its unpacked custom_mask, row-major per request). offsets [R+1] (packed only): each
    request's packed segment starts at offsets[r] instead, zeros after it up to offsets[r+1]."""
    if offsets is not None:
        out = np.zeros(int(offsets[-1]), np.uint8)
        starts = byte_indptr(q_lens, kv_lens)
        dense = host_mask(q_lens, kv_lens, tree_bits)
        for r in range(q_lens.shape[0]):
            n = int(starts[r + 1] - starts[r])
            out[int(offsets[r]) : int(offsets[r]) + n] = dense[starts[r] : starts[r + 1]]
        return out
    segments = []
    t = 0
    for q, kv in zip(q_lens.tolist(), kv_lens.tolist()):
        bits = tree_bits[t : t + q].astype(np.uint64)
        tree = ((bits[:, None] >> np.arange(q, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(bool)
        dense = np.concatenate([np.ones((q, kv - q), bool), tree], axis=1).reshape(-1)
        segments.append(np.packbits(dense, bitorder="little") if packed else dense)
        t += q
    return np.concatenate(segments) if segments else np.zeros(0, np.uint8 if packed else bool)


@functools.cache
def _kernel():
    """The compiled-on-first-use Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # (ImportError, or a Triton install that cannot load here)
        return None

    @triton.jit
    def tree_mask(qo_ptr, kv_ptr, seg_ptr, bits_ptr, out_ptr, PACKED: tl.constexpr, BLOCK: tl.constexpr):
        # grid (blocks of the longest segment, requests): qo [R+1], kv [R], seg [R+1] int32 (byte offsets
        # when PACKED, else bit offsets), bits [sum q] int64 (a uint64 ancestor set), out uint8 / bool
        r = tl.program_id(1)
        q0 = tl.load(qo_ptr + r)
        q = tl.load(qo_ptr + r + 1) - q0
        kv = tl.load(kv_ptr + r)
        s0 = tl.load(seg_ptr + r)
        n = tl.load(seg_ptr + r + 1) - s0
        prefix = kv - q
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = k < n
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(8 if PACKED else 1):  # (a byte's 8 bits, or one bit per element)
            b = k * (8 if PACKED else 1) + i
            row = b // kv
            col = b - row * kv
            ok = live & (row < q)
            anc = tl.load(bits_ptr + q0 + row, mask=ok, other=0)
            shift = tl.maximum(col - prefix, 0).to(tl.int64)
            bit = ok & ((col < prefix) | (((anc >> shift) & 1) != 0))
            acc = acc | (bit.to(tl.int32) << i)
        if PACKED:
            tl.store(out_ptr + s0 + k, acc.to(tl.uint8), mask=live)
        else:
            tl.store(out_ptr + s0 + k, acc != 0, mask=live)

    return triton, tree_mask


def available() -> bool:
    """Whether the Triton kernel can be built here (Triton imports)."""
    return _kernel() is not None


def pack(qo_indptr: torch.Tensor, kv_lens: torch.Tensor, segments: torch.Tensor, tree_bits: torch.Tensor,
         out: torch.Tensor, longest: int, packed: bool = True) -> torch.Tensor:
    """Write the mask into out: qo_indptr [R+1], kv_lens [R], segments [R+1] int32 (byte_indptr when packed,
    else each request's bit offsets, cumsum of q * kv), tree_bits [sum q] int64 (DraftTree.masks viewed as
    int64), all on out's device; out uint8 [segments[-1]] (packed) or bool (unpacked), at least that long.
    longest: the longest segment (bytes or bits; a host int, so no device read). Returns out."""
    triton, kernel = _kernel()
    R = kv_lens.shape[0]
    if R and longest:
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():  # (CPU: the interpreter)
            # (blocks on grid axis 0, up to 2^31 - 1; requests on axis 1, up to 65,535)
            kernel[(triton.cdiv(longest, BLOCK), R)](qo_indptr, kv_lens, segments, tree_bits, out, PACKED=packed,
                                                     BLOCK=BLOCK)
    return out

