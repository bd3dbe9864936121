"""The device half of an unbucketed StepRows (or CrossRows) commit: the page table's rows gathered into
the CSR page lists backends read.

`gather_csr` writes FlashInfer's (and the reference's) CSR page list of every layer group from the
pool's page table: out[indptr[i] + j] = table[rows[i], first_page[i] + j] for j < indptr[i+1] -
indptr[i], with a few torch ops over the [rows, width] domain whose masked lanes write a dump
element. Capturable: every size is the step's row count or the table's width, no value is read back
to the host. Bucketed StepRows steps use capture/derive.py instead, which on CUDA reads only the pages used.
"""

from __future__ import annotations

import torch


def gather_csr(table: torch.Tensor, width: int, rows: torch.Tensor, buf: torch.Tensor, groups, capacity: int) -> None:
    """Fill every group's CSR page list from the table. All int32 on one device.

    table [(max_requests + 1) * width + 1] (the last element a dump); rows [R] table rows; buf: the
    pool slot's flat buffer; groups: the layout's GroupOffsets per group (kv_indptr [R+1], first_page
    [R], indices [capacity + 1, the last a dump] are read and written).
    """
    R = rows.shape[0]
    col = torch.arange(width, dtype=torch.int64, device=buf.device)
    base = rows.long().mul_(width)
    for g in groups:
        m, f, o = g.kv_indptr, g.first_page, g.indices
        indptr, first = buf[m : m + R + 1], buf[f : f + R]
        count = indptr[1:] - indptr[:-1]
        ok = col < count[:, None]
        src = torch.where(ok, (base + first)[:, None] + col, 0)
        dst = torch.where(ok, indptr[:-1, None].long() + col, capacity)
        buf[o : o + capacity + 1].index_copy_(0, dst.view(-1), table[src.view(-1)])
