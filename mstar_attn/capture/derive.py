"""The device half of a bucketed StepRows commit: every array a backend reads, derived on the device
from the two arrays the host stages (each request's table row and KV length). Capturable.

The host writes rows [R] and kv_lens [R] (padding requests: the table's scratch row and q_len) and
the table entries assigned since the last commit into the head of a pool slot (layout.py), one
copy moves them, and `derive_rows` fills, for a step of R requests of q_len tokens each (decode:
q_len 1, verify: 2..16):

    qo_indptr [R+1]            i * q_len
    per layer group g:
      first_page [R]           the first logical page the group reads: 0, or for a window W group
                               max(kv - q_len - (W - 1), 0) // page_size
      kv_indptr [R+1]          exclusive prefix sum of need - first_page, need = ceil(kv / page_size)
      kv_last_page_len [R]     kv - (need - 1) * page_size
      kv_lens [R]              kv - first_page * page_size
      indices                  table[rows[i], first_page[i] : need[i]], request after request
    slot_mapping [R * q_len]   int64: table[rows[i], p // page_size] * page_size + p % page_size for
                               the positions p = kv - q_len .. kv - 1 of request i

These are exactly the arrays build_plan computes on the host for the same step (plus the padding
requests commit used to stage): tests/capture/test_derive.py checks the two against each other.
On CUDA with Triton installed it is two launches (the table scatter, then one program per request
and layer group deriving its entries and copying only the pages it reads); elsewhere torch ops.
"""

from __future__ import annotations

import functools

import torch

from mstar_attn.capture.expand import gather_csr
from mstar_attn.capture.layout import Offsets

USE_TRITON = True  # the two-launch Triton path on CUDA (False: the torch ops, as on the CPU)


@functools.cache
def triton_kernels():
    """(scatter, derive) Triton kernels (capture/_derive_triton.py), or None when Triton is not installed."""
    try:
        from mstar_attn.capture import _derive_triton
    except ImportError:
        return None
    return _derive_triton.scatter, _derive_triton.derive


def window_sizes(groups) -> tuple[int, ...]:
    """Per layer group, its window W (0: it reads from position 0)."""
    return tuple(g.window or 0 for g in groups)


def apply_updates(table: torch.Tensor, buf: torch.Tensor, offsets: Offsets, kernels=None) -> None:
    """Scatter the staged table updates (positions [U], then values [U], int32 in buf at
    offsets.updates; unused lanes name the table's dump element) into the device table."""
    at, U = offsets.updates, offsets.update_capacity
    if kernels is not None:
        kernels[0][(1,)](table, buf, at, U, BLOCK=max(16, 1 << (U - 1).bit_length()))
        return
    table.index_copy_(0, buf[at : at + U].long(), buf[at + U : at + 2 * U])


def derive_rows(buf: torch.Tensor, offsets: Offsets, table: torch.Tensor, width: int, windows: tuple[int, ...],
                windows_dev: torch.Tensor, q_len: int, page_size: int, capacity: int, kernels=None) -> None:
    """Fill a bucketed StepRows step's arrays in the slot buffer `buf` (int32, one device) from its
    staged rows and kv_lens (see the module docstring). table: the page table [(max_requests + 1)
    * width + 1] int32 on buf's device (updates applied); windows: per group W or 0, windows_dev the
    same as an int32 tensor on the device; capacity: each group's index region (P). kernels: the
    Triton kernels (triton_kernels()), or None for torch ops. Reads nothing back to the host."""
    R, G, ps = offsets.rows, len(offsets.groups), page_size
    if kernels is not None:
        g0 = offsets.groups[0]
        stride = offsets.groups[1][0] - g0[0] if G > 1 else 0
        istride = offsets.groups[1][4] - g0[4] if G > 1 else 0
        slots = buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64)
        kernels[1][(R, G)](buf, slots, table, width, windows_dev, R, q_len, ps, offsets.table_rows, offsets.kv_lens,
                           offsets.qo, g0[0], stride, g0[3], g0[4], istride, BLOCK_R=max(16, 1 << (R - 1).bit_length()),
                           BLOCK_Q=16, BLOCK_P=128)
        return
    kv = buf[offsets.kv_lens : offsets.kv_lens + R]
    rows = buf[offsets.table_rows : offsets.table_rows + R]
    buf[offsets.qo : offsets.qo + R + 1].copy_(torch.arange(R + 1, device=buf.device) * q_len)
    need = (kv + (ps - 1)).div_(ps, rounding_mode="floor")
    for (o_ptr, o_lpl, o_len, o_first, _), w in zip(offsets.groups, windows):
        first = (kv - (q_len + w - 1)).clamp_(min=0).div_(ps, rounding_mode="floor") if w else torch.zeros_like(kv)
        buf[o_first : o_first + R] = first
        buf[o_ptr : o_ptr + 1] = 0
        torch.cumsum(need - first, 0, out=buf[o_ptr + 1 : o_ptr + R + 1])
        buf[o_lpl : o_lpl + R] = kv - (need - 1) * ps
        buf[o_len : o_len + R] = kv - first * ps
    pos = (kv[:, None] - q_len).long() + torch.arange(q_len, device=buf.device)
    page = table[rows.long()[:, None] * width + pos.div(ps, rounding_mode="floor")]
    buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64).copy_((page.long() * ps + pos % ps).view(-1))
    gather_csr(table, width, rows, buf, offsets.groups, capacity)
