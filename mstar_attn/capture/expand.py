"""The device half of a StepRows commit: the page table's rows gathered into the arrays backends read.

`gather_csr` writes FlashInfer's (and the reference's) CSR page list of every layer group from the
pool's page table: out[indptr[i] + j] = table[rows[i], first_page[i] + j] for j < indptr[i+1] -
indptr[i]. On CUDA it is one Triton launch for all groups when Triton is installed (a program per
request and group, reading only the pages used); elsewhere a few torch ops over the [rows, width]
domain, whose masked lanes write a dump element. Both are capturable: every size is the step's
row count or the table's width, no value is read back to the host.
"""

from __future__ import annotations

import functools

import torch


USE_TRITON = False  # off until the illegal memory access seen on the H100 in the FlashInfer page-table runs is explained


@functools.cache
def _triton_kernel():
    """The Triton gather, or None when Triton is not installed (made once, on first CUDA use)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather(table, width, rows, indptr, indptr_stride, first, first_stride, out, out_stride, BLOCK: tl.constexpr):
        i, g = tl.program_id(0), tl.program_id(1)
        row = tl.load(rows + i).to(tl.int64)
        lo = tl.load(indptr + g * indptr_stride + i)
        n = tl.load(indptr + g * indptr_stride + i + 1) - lo
        src = table + row * width + tl.load(first + g * first_stride + i)
        dst = out + g * out_stride + lo
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < n
            tl.store(dst + j, tl.load(src + j, mask=m), mask=m)

    return gather


def gather_csr(table: torch.Tensor, width: int, rows: torch.Tensor, buf: torch.Tensor, groups, capacity: int) -> None:
    """Fill every group's CSR page list from the table. All int32 on one device.

    table [(max_requests + 1) * width + 1] (the last element a dump); rows [R] table rows; buf: the
    pool slot's flat buffer; groups: the layout's offsets per group, (kv_indptr [R+1], last_page_len,
    kv_lens, first_page [R], indices [capacity + 1, the last a dump]). The layout spaces each kind of
    array evenly over the groups, so Triton covers every group in one launch.
    """
    R, G = rows.shape[0], len(groups)
    kernel = _triton_kernel() if buf.is_cuda and USE_TRITON else None
    if kernel is not None:
        stride = [groups[1][k] - groups[0][k] if G > 1 else 0 for k in (0, 3, 4)]
        g0 = groups[0]
        kernel[(R, G)](table, width, rows, buf[g0[0]:], stride[0], buf[g0[3]:], stride[1], buf[g0[4]:], stride[2], BLOCK=128)
        return
    col = torch.arange(width, dtype=torch.int64, device=buf.device)
    base = rows.long().mul_(width)
    for m, _, _, f, o in groups:
        indptr, first = buf[m : m + R + 1], buf[f : f + R]
        count = indptr[1:] - indptr[:-1]
        ok = col < count[:, None]
        src = torch.where(ok, (base + first)[:, None] + col, 0)
        dst = torch.where(ok, indptr[:-1, None].long() + col, capacity)
        buf[o : o + capacity + 1].index_copy_(0, dst.view(-1), table[src.view(-1)])
