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
On CUDA with Triton installed the whole derivation is one launch that reads the slot's pinned staging
directly (no copy first; past COPY_FIRST requests a copy kernel first, see there), applies the table
updates, writes the device's copy of the head, derives every entry (one program per request and layer
group, copying only the pages it reads) and, once every program has read the staging, writes the
commit's fence back (capture/lease.py): one GPU item per step (two past COPY_FIRST).
Elsewhere: the head copy, torch ops, and the fence copy.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import attrs
import torch

from mstar_attn.capture.gather import gather_csr
from mstar_attn.capture.layout import Offsets
from mstar_attn.metadata.plan import AttentionPlan, Mode
from mstar_attn.metadata.tree import MAX_TREE_NODES

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep

USE_TRITON = True  # the one-launch Triton path on CUDA (False: the torch ops, as on the CPU)
# Past this many requests (padded) the kernel reads a device copy of the head, not the pinned staging: each of its
# (R + 1) x G programs reads every request's length for its prefix sum, about 6 small reads over the bus each,
# against one small copy kernel first (_derive_triton.copy_head) and reads from device memory. H200, device work per
# step (benchmarks/derive_kernel.py, results/derive_kernel_h200.md): read in place 3.74 µs at B = 1 against 4.77 with
# the copy, 7.52 against 5.25 at 16; about equal at 4 and 8 (in the run before, 5.28 against 4.43 at 8). (An H100 run
# of an older kernel had the reads in place faster at 8: results/derive_kernel_h100.json.) A Derivation reads it when made
# (Derivation.copy_first). One program deriving every request from one read of the staging was slower than the
# faster of these at every B up to 16 (results/derive_kernel_runs).
COPY_FIRST = 4


@functools.cache
def triton_kernel():
    """The derive Triton kernel (capture/_derive_triton.py), or None when Triton is not installed."""
    try:
        from mstar_attn.capture import _derive_triton
    except ImportError:
        return None
    return _derive_triton.derive


def _copy_kernel():
    """(copy_head, its block) of capture/_derive_triton.py: imported where the derive kernel runs."""
    from mstar_attn.capture import _derive_triton

    return _derive_triton.copy_head, _derive_triton.BLOCK_HEAD


@attrs.frozen
class CrossPages:
    """The cross table a derived StepBatch decode step's cross group reads its pages from (capture/cross.py): its
    entries (int32 [(max_requests + 1) * width + 1] on the device, the last a dump), its width, and the layer group."""

    table: torch.Tensor
    width: int
    group: int


def cross_pages(spec, cross_table) -> CrossPages | None:
    """The CrossPages a pool's listed steps derive their cross group from: a spec whose only own-list group is one
    cross group, not group 0, with a cross table (capture/table.PageTable); else None."""
    own = spec.own_page_groups
    if cross_table is None or len(own) != 1 or own[0] == 0:
        return None
    return CrossPages(table=cross_table.dev, width=cross_table.width, group=own[0])


class Derivation:
    """What a pool's derivations share: the page table (int32 [(max_requests + 1) * width + 1] on the
    device, the last element a dump; a pool without one: one int32, width 0, for listed steps alone) and its
    width, each layer group's window W (0: none) on the host
    and as an int32 device tensor, the page size, each group's index capacity (P), and the Triton
    kernel (None: torch ops) with one int32 device counter per pool slot (num_slots; the kernel's
    count of programs done, 0 between launches) and one cell it writes the fence to when it has none.
    cross: the cross table a listed step's cross group reads (a spec whose only own-list group is one cross group,
    not group 0), or None.
    Per slot shape it keeps the kernel's meta vectors (int32 [20 + G] on the device, one for StepRows steps and
    one for listed steps, made at the shape's first, uncaptured, commit): bounded by the buckets. copy_first
    (COPY_FIRST when made): past this many requests the kernel reads the head's device copy, which the copy kernel
    (with the kernel) makes first; fixed for the Derivation's life, so a key's captured work never changes its reads."""

    def __init__(self, table: torch.Tensor, width: int, groups, page_size: int, capacity: int, kernel=None,
                 num_slots: int = 2, cross: CrossPages | None = None):
        self.table, self.width, self.page_size, self.capacity, self.kernel = table, width, page_size, capacity, kernel
        self.cross = cross
        self.copy_first = COPY_FIRST
        self.copy_kernel, self.copy_block = _copy_kernel() if kernel is not None else (None, 0)
        self.windows = tuple(g.window or 0 for g in groups)
        # (one cell per 16 bytes, as the fences: one compiled kernel for every slot)
        self.counters = torch.zeros(4 * (num_slots + 1) if kernel is not None else 0, dtype=torch.int32, device=table.device)
        self._meta: dict[tuple[int, int, bool], torch.Tensor] = {}  # (rows, token rows, listed) -> meta

    def memory(self) -> dict[str, tuple[int, int]]:
        """Device bytes of the counters and the meta vectors made so far (host: none)."""
        n = self.counters.numel() * 4 + sum(m.numel() * 4 for m in self._meta.values())
        return {f"derive meta ({len(self._meta)} shapes)": (n, 0)}

    def meta(self, offsets: Offsets, q_len: int, listed: bool = False) -> torch.Tensor:
        """The derive kernel's meta vector for one slot shape, of StepRows steps or listed ones (see
        _derive_triton.derive; a listed step's has no table updates, and names the cross group if the spec has one)."""
        key = (offsets.batch_size, offsets.num_tokens, listed)
        m = self._meta.get(key)
        if m is None:
            g, G = offsets.groups, len(offsets.groups)
            stride = (g[1].kv_indptr - g[0].kv_indptr, g[1].indices - g[0].indices) if G > 1 else (0, 0)
            m = self._meta[key] = torch.tensor(
                [offsets.batch_size, q_len, self.page_size, self.width, offsets.table_rows, offsets.kv_lens, offsets.qo,
                 g[0].kv_indptr, stride[0], g[0].first_page, g[0].indices, stride[1], offsets.updates,
                 0 if listed else offsets.update_capacity, offsets.fence, offsets.slots, int(listed),
                 -1 if self.cross is None or not listed else self.cross.group, offsets.cross_lens,
                 0 if self.cross is None else self.cross.width, *self.windows],
                dtype=torch.int32, device=self.table.device)
        return m


def listed_step(plan: AttentionPlan) -> bool:
    """Whether a bucketed step of a spec whose groups read the shared list (but one cross group: the pool decides, see
    GraphBufferPool.commit) is a StepBatch decode step the device derives like a StepRows one, from its KV lengths and
    its exact page lists (build_plan's kv_indptr and kv_indices: the pages each length needs, from logical page 0): a
    plain decode step, no cascade, draft round or token tree."""
    return plan.rows is None and plan.mode is Mode.DECODE and plan.cascade is None and plan.draft_step is None \
        and plan.tree is None


def work_key(step: DeviceStep, derived: bool) -> tuple:
    """The graph key of a commit's device work (rows_work): derived from the page table (a StepRows step), from its
    staged lists (a listed step), or the staged arrays' copy and gather (`derived` False)."""
    kind = "staged" if not derived else "derived" if step.plan.rows is not None else "listed"
    return kind, step.slot, step.padded_batch_size, step.padded_num_tokens, step.plan.backend


def apply_updates(table: torch.Tensor, buf: torch.Tensor, offsets: Offsets) -> None:
    """Scatter the staged table updates (positions [U], then values [U], int32 in buf at
    offsets.updates; unused lanes name the table's dump element) into the device table (torch ops)."""
    at, U = offsets.updates, offsets.update_capacity
    table.index_copy_(0, buf[at : at + U].long(), buf[at + U : at + 2 * U])


def derive_staged(buf: torch.Tensor, src: torch.Tensor, offsets: Offsets, q_len: int, d: Derivation,
                  fence: torch.Tensor | None, slot: int, listed: bool = False) -> None:
    """A bucketed StepRows step's whole device work by the Triton kernels: from its staged head in `src` (the
    slot's int32 staging, pinned on CUDA) into the slot buffer `buf` (int32, on the table's device): the table
    updates applied, the head's rows and kv_lens copied, every derived array filled (q_len tokens per request);
    `fence` (an int32 [1] pinned cell, or None) gets the staged fence value once the staging was read. slot: the
    pool slot (its counter). Up to d.copy_first requests one launch reads `src` in place; past it the copy kernel
    moves the head (up to offsets.draft) into `buf` first and the derive kernel reads that: two launches.
    listed: a StepBatch decode step (listed_step): each request's pages are read from its exact list, staged in
    `src` at group 0's indices offset (always the staging itself), instead of from the page table; no updates; its
    cross group (d.cross), if any, from the cross table's rows staged at the head's table_rows, its encoder lengths at
    cross_lens."""
    R, G = offsets.batch_size, len(offsets.groups)
    if not 0 <= slot < d.counters.numel() // 4 - 1:
        raise ValueError(f"derive_staged: slot {slot}, but the Derivation counts {d.counters.numel() // 4 - 1} slots")
    if q_len > MAX_TREE_NODES:  # (the kernel maps up to that many tokens per request: _derive_triton.BLOCK_Q)
        raise ValueError(f"derive_staged: q_len {q_len}, more than the {MAX_TREE_NODES} tokens a request's step holds")
    pages = src if listed else d.table
    xtable = d.table if d.cross is None else d.cross.table  # (read only by a listed step's cross group)
    if R > d.copy_first:  # (the kernel then rewrites the head's rows and lengths in place with the values it read)
        d.copy_kernel[(-(-offsets.draft // d.copy_block),)](buf, src, offsets.draft, BLOCK=d.copy_block)
        src = buf
    d.kernel[(R + 1, G)](buf, src, pages, xtable, d.meta(offsets, q_len, listed), d.counters[4 * slot : 4 * slot + 1],
                         d.counters[-4:-3] if fence is None else fence, BLOCK_R=max(16, 1 << (R - 1).bit_length()))


def _spans(buf: torch.Tensor, offsets: Offsets, q_len: int, d: Derivation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qo_indptr and each group's first_page, kv_indptr, last_page_len and kv_lens into `buf` from the kv_lens in
    its head (a listed step's cross group, d.cross: from its encoder lengths, _cross_spans) (torch ops); returns (kv
    [R] int32, the pages each length needs [R] int32, the tokens' positions [R, q_len] int64)."""
    R, ps = offsets.batch_size, d.page_size
    kv = buf[offsets.kv_lens : offsets.kv_lens + R]
    buf[offsets.qo : offsets.qo + R + 1].copy_(torch.arange(R + 1, device=buf.device) * q_len)
    need = (kv + (ps - 1)).div_(ps, rounding_mode="floor")
    for g, (o, w) in enumerate(zip(offsets.groups, d.windows)):
        if d.cross is not None and g == d.cross.group:
            _cross_spans(buf, offsets, o, d)
            continue
        o_ptr, o_lpl, o_len, o_first = o.kv_indptr, o.last_page_len, o.kv_lens, o.first_page
        first = (kv - (q_len + w - 1)).clamp_(min=0).div_(ps, rounding_mode="floor") if w else torch.zeros_like(kv)
        buf[o_first : o_first + R] = first
        buf[o_ptr : o_ptr + 1] = 0
        torch.cumsum(need - first, 0, out=buf[o_ptr + 1 : o_ptr + R + 1])
        buf[o_lpl : o_lpl + R] = kv - (need - 1) * ps
        buf[o_len : o_len + R] = kv - first * ps
    return kv, need, (kv[:, None] - q_len).long() + torch.arange(q_len, device=buf.device)


def _cross_spans(buf: torch.Tensor, offsets: Offsets, o, d: Derivation) -> None:
    """A listed step's cross group's first_page (0), kv_indptr, last_page_len and kv_lens (o: its GroupOffsets) into
    `buf` from the encoder lengths at the head's cross_lens (torch ops)."""
    R, ps = offsets.batch_size, d.page_size
    kv = buf[offsets.cross_lens : offsets.cross_lens + R]
    need = (kv + (ps - 1)).div_(ps, rounding_mode="floor")
    buf[o.first_page : o.first_page + R] = 0
    buf[o.kv_indptr : o.kv_indptr + 1] = 0
    torch.cumsum(need, 0, out=buf[o.kv_indptr + 1 : o.kv_indptr + R + 1])
    buf[o.last_page_len : o.last_page_len + R] = kv - (need - 1) * ps
    buf[o.kv_lens : o.kv_lens + R] = kv


def derive_rows(buf: torch.Tensor, offsets: Offsets, q_len: int, d: Derivation) -> None:
    """Fill a bucketed StepRows step's arrays in the slot buffer `buf` (int32, on the table's device)
    from its rows and kv_lens in buf's head (see the module docstring), q_len tokens per request, the
    table's updates applied (torch ops; the Triton kernel: derive_staged). Reads nothing back to the host."""
    R, ps = offsets.batch_size, d.page_size
    rows = buf[offsets.table_rows : offsets.table_rows + R]
    _, _, pos = _spans(buf, offsets, q_len, d)
    page = d.table[rows.long()[:, None] * d.width + pos.div(ps, rounding_mode="floor")]
    buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64).copy_((page.long() * ps + pos % ps).view(-1))
    gather_csr(d.table, d.width, rows, buf, offsets.groups, d.capacity)


def derive_listed(buf: torch.Tensor, offsets: Offsets, q_len: int, d: Derivation) -> None:
    """Fill a bucketed StepBatch decode step's arrays (listed_step) in the slot buffer `buf` (int32) from the
    kv_lens in its head and each request's exact page list, request after request, in group 0's index region
    (padding requests: q_len tokens, one scratch page each), as derive_rows does from the page table (torch ops:
    every group's list gathered over the whole index region; the Triton kernel: derive_staged(listed=True)); a cross
    group (d.cross) from its encoder lengths (the head's cross_lens) and the cross table's rows (table_rows)."""
    R, ps, cap = offsets.batch_size, d.page_size, d.capacity
    i0 = offsets.groups[0].indices
    lists = buf[i0 : i0 + cap].clone()  # (group 0's own list is rewritten below: a window group's is trimmed)
    _, need, pos = _spans(buf, offsets, q_len, d)
    start = torch.cumsum(need.long(), 0) - need  # where each request's list starts in `lists`
    page = lists[(start[:, None] + pos.div(ps, rounding_mode="floor")).clamp_(max=cap - 1)]
    buf[offsets.slots : offsets.slots + 2 * R * q_len].view(torch.int64).copy_((page.long() * ps + pos % ps).view(-1))
    j = torch.arange(cap, device=buf.device)
    x = d.cross
    for g, o in enumerate(offsets.groups):
        if x is not None and g == x.group:  # the cross group (its spans: _spans): its pages from the cross table's rows
            gather_csr(x.table, x.width, buf[offsets.table_rows : offsets.table_rows + R], buf, (o,), cap)
            continue
        indptr, first = buf[o.kv_indptr : o.kv_indptr + R + 1].long(), buf[o.first_page : o.first_page + R].long()
        i = (torch.searchsorted(indptr[1:], j, right=True)).clamp_(max=R - 1)  # the request entry j belongs to
        src = (start[i] + first[i] + j - indptr[i]).clamp_(0, cap - 1)
        dst = torch.where(j < indptr[R], j, cap)  # (past the step's entries: the dump)
        buf[o.indices : o.indices + cap + 1].index_copy_(0, dst, lists[src])


def rows_work(d: Derivation, dev: torch.Tensor, host: torch.Tensor, fence: torch.Tensor | None, step: DeviceStep,
              state, offsets: Offsets, derived: bool) -> Callable[[], None]:
    """A StepRows commit's device work on the step's slot (dev: its int32 device buffer, host: its pinned staging,
    d: the pool's Derivation, over its page table): copy the staged head, apply the table updates, derive the
    step's arrays (derived: a bucketed step; else they were staged) or gather the CSR page lists, then each
    backend's own arrays (PoolState.gather); with `fence` (a derived step on CUDA: the slot's pinned fence cell)
    the commit's generation is written there once the staging was read (capture/lease.py): by the derive kernel
    (derive_staged: the whole derived work, the copy and the updates included, in one or two launches), else by
    a last copy. A listed step (a StepBatch decode step, listed_step) reads its pages from its staged lists, and its
    torch path copies group 0's whole index region too. Returns the work: device ops of fixed
    sizes (its copy moves the head up to offsets.draft, derived, or offsets.head_end int32 elements)."""
    U = offsets.update_capacity
    end = offsets.draft if derived else offsets.head_end  # (derived: the rows, lengths and updates only)

    fused = derived and d.kernel is not None  # (the Triton kernels read the staging and write the fence)
    listed = step.plan.rows is None  # (a derived StepBatch decode step: its pages from its staged lists)
    i0 = offsets.groups[0].indices

    def work():
        if fused:
            derive_staged(dev, host, offsets, step.q_len, d, fence, step.slot, listed)
        elif listed:
            dev[:end].copy_(host[:end], non_blocking=True)
            dev[i0 : i0 + d.capacity].copy_(host[i0 : i0 + d.capacity], non_blocking=True)
            derive_listed(dev, offsets, step.q_len, d)
        elif derived:
            dev[:end].copy_(host[:end], non_blocking=True)
            apply_updates(d.table, dev, offsets)
            derive_rows(dev, offsets, step.q_len, d)
        else:
            dev[:end].copy_(host[:end], non_blocking=True)
            at = offsets.updates
            d.table.index_copy_(0, dev[at : at + U].long(), dev[at + U : at + 2 * U])
            gather_csr(d.table, d.width, step.table_rows, dev, offsets.groups, d.capacity)
        if state is not None and not listed:  # a backend's own arrays (dense page tables, from the page table)
            state.gather(step)
        if fence is not None and not fused:  # the last node
            fence.copy_(dev[offsets.fence : offsets.fence + 1], non_blocking=True)

    return work
