"""The device half of a bucketed StepRows commit: every array a backend reads, derived on the device
from the two arrays the host stages (each request's table row and KV length). Capturable.

The host writes rows [R] and kv_lens [R] (padding requests: the table's scratch row and q_len) and
the table entries assigned since the last commit into the head of a pool slot (layout.py), one
copy moves them, and `derive_rows` fills, for a step of R requests of q_len tokens each (decode:
q_len 1, verify: 2..16, a token-tree verify step up to PoolLimits.max_tree_nodes, at most 64):

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
from typing import TYPE_CHECKING, Callable

import torch

from mstar_attn.capture.gather import gather_csr
from mstar_attn.capture.layout import Offsets

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep

USE_TRITON = True  # the two-launch Triton path on CUDA (False: the torch ops, as on the CPU)


@functools.cache
def triton_kernels():
    """(scatter, derive) Triton kernels (capture/_derive_triton.py), or None when Triton is not installed."""
    try:
        from mstar_attn.capture import _derive_triton
    except ImportError:
        return None
    return _derive_triton.scatter, _derive_triton.derive


class Derivation:
    """What a pool's derivations share: the page table (int32 [(max_requests + 1) * width + 1] on the
    device, the last element a dump) and its width, each layer group's window W (0: none) on the host
    and as an int32 device tensor, the page size, each group's index capacity (P), and the Triton
    kernels (None: torch ops). Per slot shape it keeps the Triton kernel's meta vector (int32 [12]
    on the device, made at the shape's first, uncaptured, commit): bounded by the buckets."""

    def __init__(self, table: torch.Tensor, width: int, groups, page_size: int, capacity: int, kernels=None):
        self.table, self.width, self.page_size, self.capacity, self.kernels = table, width, page_size, capacity, kernels
        self.windows = tuple(g.window or 0 for g in groups)
        self.windows_dev = torch.tensor(self.windows, dtype=torch.int32, device=table.device)
        self._meta: dict[tuple[int, int], torch.Tensor] = {}

    def memory(self) -> dict[str, tuple[int, int]]:
        """Device bytes of the windows and the meta vectors made so far (host: none)."""
        n = self.windows_dev.numel() * 4 + sum(m.numel() * 4 for m in self._meta.values())
        return {f"derive meta ({len(self._meta)} shapes)": (n, 0)}

    def meta(self, offsets: Offsets, q_len: int) -> torch.Tensor:
        """The derive kernel's meta vector for one slot shape (see _derive_triton.derive)."""
        key = (offsets.batch_size, offsets.num_tokens)
        m = self._meta.get(key)
        if m is None:
            g, G = offsets.groups, len(offsets.groups)
            stride = (g[1].kv_indptr - g[0].kv_indptr, g[1].indices - g[0].indices) if G > 1 else (0, 0)
            m = self._meta[key] = torch.tensor(
                [offsets.batch_size, q_len, self.page_size, self.width, offsets.table_rows, offsets.kv_lens, offsets.qo,
                 g[0].kv_indptr, stride[0], g[0].first_page, g[0].indices, stride[1]], dtype=torch.int32,
                device=self.table.device)
        return m


def apply_updates(table: torch.Tensor, buf: torch.Tensor, offsets: Offsets, kernels=None) -> None:
    """Scatter the staged table updates (positions [U], then values [U], int32 in buf at
    offsets.updates; unused lanes name the table's dump element) into the device table."""
    at, U = offsets.updates, offsets.update_capacity
    if kernels is not None:
        kernels[0][(1,)](table, buf, at, U, BLOCK=max(16, 1 << (U - 1).bit_length()))
        return
    table.index_copy_(0, buf[at : at + U].long(), buf[at + U : at + 2 * U])


def derive_rows(buf: torch.Tensor, offsets: Offsets, q_len: int, d: Derivation) -> None:
    """Fill a bucketed StepRows step's arrays in the slot buffer `buf` (int32, on the table's device)
    from its staged rows and kv_lens (see the module docstring), q_len tokens per request, the
    table's updates applied. Reads nothing back to the host."""
    R, ps = offsets.batch_size, d.page_size
    if d.kernels is not None:
        slots = buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64)
        d.kernels[1][(R, len(offsets.groups))](buf, slots, d.table, d.windows_dev, d.meta(offsets, q_len),
                                               BLOCK_R=max(16, 1 << (R - 1).bit_length()),
                                               BLOCK_Q=max(16, 1 << (q_len - 1).bit_length()), BLOCK_P=128)
        return
    kv = buf[offsets.kv_lens : offsets.kv_lens + R]
    rows = buf[offsets.table_rows : offsets.table_rows + R]
    buf[offsets.qo : offsets.qo + R + 1].copy_(torch.arange(R + 1, device=buf.device) * q_len)
    need = (kv + (ps - 1)).div_(ps, rounding_mode="floor")
    for o, w in zip(offsets.groups, d.windows):
        o_ptr, o_lpl, o_len, o_first = o.kv_indptr, o.last_page_len, o.kv_lens, o.first_page
        first = (kv - (q_len + w - 1)).clamp_(min=0).div_(ps, rounding_mode="floor") if w else torch.zeros_like(kv)
        buf[o_first : o_first + R] = first
        buf[o_ptr : o_ptr + 1] = 0
        torch.cumsum(need - first, 0, out=buf[o_ptr + 1 : o_ptr + R + 1])
        buf[o_lpl : o_lpl + R] = kv - (need - 1) * ps
        buf[o_len : o_len + R] = kv - first * ps
    pos = (kv[:, None] - q_len).long() + torch.arange(q_len, device=buf.device)
    page = d.table[rows.long()[:, None] * d.width + pos.div(ps, rounding_mode="floor")]
    buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64).copy_((page.long() * ps + pos % ps).view(-1))
    gather_csr(d.table, d.width, rows, buf, offsets.groups, d.capacity)


def rows_work(d: Derivation, dev: torch.Tensor, host: torch.Tensor, fence: torch.Tensor | None, step: DeviceStep,
              state, offsets: Offsets, derived: bool) -> Callable[[], None]:
    """A StepRows commit's device work on the step's slot (dev: its int32 device buffer, host: its pinned staging,
    d: the pool's Derivation, over its page table): copy the staged head, apply the table updates, derive the
    step's arrays (derived: a bucketed step; else they were staged) or gather the CSR page lists, then each
    backend's own arrays (PoolState.gather); with `fence` (a derived step on CUDA: the slot's pinned fence cell)
    the last node copies the commit's generation there (capture/lease.py). Returns the work: device ops of fixed
    sizes (its copy moves the head up to offsets.draft, derived, or offsets.head_end int32 elements)."""
    U = offsets.update_capacity
    end = offsets.draft if derived else offsets.head_end  # (derived: the rows, lengths and updates only)

    def work():
        dev[:end].copy_(host[:end], non_blocking=True)
        if derived:
            apply_updates(d.table, dev, offsets, d.kernels)
            derive_rows(dev, offsets, step.q_len, d)
        else:
            at = offsets.updates
            d.table.index_copy_(0, dev[at : at + U].long(), dev[at + U : at + 2 * U])
            gather_csr(d.table, d.width, step.table_rows, dev, offsets.groups, d.capacity)
        if state is not None:  # a backend's own arrays (dense page tables)
            state.gather(step)
        if fence is not None:  # the last node
            fence.copy_(dev[offsets.fence : offsets.fence + 1], non_blocking=True)

    return work
