"""Where each array of a committed step lives inside one pool slot's flat int32 buffer. Pure.

For a step of R request rows and N token rows (a bucketed step: R = bucket, N = R * q_len; any
other step: R = B, N = T) the arrays sit back to back, so a commit copies one contiguous range
per layer group and nothing the step does not use:

    rows [R] | first_page [G * R] | kv_lens [R] | cross_lens [R] | table updates: positions [U], values [U] |
    fence [1] | (pad)
    draft steps D-1 .. 1, each: slot_mapping int64 [R], per group last_page_len [R], kv_lens [R] |
    qo_indptr [R+1] | per group g: kv_indptr [R+1], last_page_len [R], kv_lens [R] | (pad)
    slot_mapping int64 [N] | one more slot_mapping int64 [N] per own_pages group (not cross) |
    group 0 indices [P + 1] | group 1 indices [P + 1] | ... | (pad) per cross group: its slots int64 [E]

The first region serves StepRows plans and CrossRows groups (the table rows, the first table column
each window group reads, the requests' KV lengths, a derived StepBatch step's cross group's encoder lengths
(capture/derive.py), the table entries assigned since the last commit,
U = R // 2 + 16 per copy): such a commit copies from 0, and the device fills the index regions (a
bucketed StepRows step copies only this region, up to `draft`, and the device derives the rest:
capture/derive.py). A cross group's slots
(E: the most encoder tokens a step stores) sit past the index regions, copied only as far as a
step stores encoder tokens (decode steps: not at all).
A StepBatch commit copies from qo_indptr through group 0's used indices, then each other group's
used indices; a draft round of K steps (D = the pool's max_draft_steps) starts that first copy
K - 1 blocks earlier, at its later steps' arrays: one copy for all K steps of a single-group spec.
Step 0 of a round and every array the steps share (qo_indptr, kv_indptr, the indices) sit where a
decode step's do. (A StepRows commit copies the head from 0, the draft region included when D > 1.)
Only the first n_g (+ padding) entries of group g's index region are used; P
(index_capacity) bounds the pages one group of one step may read, padding requests' scratch
entries included; the last entry is a dump the device gather writes its masked lanes to.
Offsets depend on (R, N), so a graph captured for a bucket reads its own fixed addresses.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class GroupOffsets:
    """int32-element offsets of one layer group's arrays in a slot, for one (R, N)."""

    kv_indptr: int  # [R+1]
    last_page_len: int  # [R]
    kv_lens: int  # [R]
    first_page: int  # [R]: the first table column a StepRows step's group reads
    indices: int  # [index_capacity + 1]: the page list, the last entry a dump


@attrs.frozen
class Offsets:
    """int32-element offsets for one (R, N); groups[g]: layer group g's GroupOffsets."""

    batch_size: int  # R: the requests (a bucketed step's padded batch)
    num_tokens: int  # N: the token rows
    table_rows: int  # the request rows' page-table rows [R] (0)
    kv_lens: int  # the requests' KV lengths [R] (a bucketed StepRows step's one length array)
    cross_lens: int  # a derived StepBatch decode step's cross group's encoder lengths [R] (its rows at table_rows)
    updates: int  # the table updates: positions [U] then values [U]
    update_capacity: int  # U
    fence: int  # one cell: the commit's generation, which a derived commit's graph writes back (capture/lease.py)
    qo: int  # qo_indptr [R+1]: a StepBatch commit copies from here
    slots: int  # slot_mapping (int64; an even int32 offset)
    groups: tuple[GroupOffsets, ...]
    head_end: int  # end of the slot mappings: group 0's indices start here
    group_slots: tuple[int, ...] = ()  # each group's slot_mapping: `slots`, or its own (own_pages, cross groups)
    end: int = 0  # the end of everything the layout places for (R, N)
    draft: int = 0  # where the draft region starts (its last step's block)
    # per draft step 1..D-1: (its slots, per group (last_page_len, kv_lens)); a round of K steps copies from draft_steps[K-2][0]
    draft_steps: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()


@attrs.frozen
class Head:
    """Where the head a derived step (a bucketed StepRows step, or a listed decode step) stages sits in a slot, for R
    requests and G layer groups: offsets of R rows, R kv_lens, R cross_lens, U update positions then U values (U =
    update_capacity), and the fence. The derive kernels (capture/_derive_triton.py) compute these from R and G alone,
    so their reads of the staging wait for no other read: a change here is a change there (tests/capture/
    test_derive.py holds the kernels' arrays to the torch ops', which read these offsets)."""

    table_rows: int
    kv_lens: int
    cross_lens: int
    updates: int
    update_capacity: int
    fence: int


def head_offsets(rows: int, groups: int) -> Head:
    """The Head of R = rows requests and G = groups layer groups (see Layout: rows [R] | first_page [G * R] | kv_lens
    [R] | cross_lens [R] | updates | fence)."""
    updates, cap = rows * (3 + groups), rows // 2 + 16
    return Head(table_rows=0, kv_lens=rows * (1 + groups), cross_lens=rows * (2 + groups), updates=updates,
                update_capacity=cap, fence=updates + 2 * cap)


@attrs.frozen
class Layout:
    """max_rows: the most request rows (the pool's max batch); max_tokens: the most token rows;
    index_capacity: P, the most page entries one group of one step holds; num_groups: G;
    slot_rows: per group, the rows of its own slot_mapping: 0, none (it writes through the step's);
    -1, the step's token rows N (an own_pages group); E > 0, E rows (a cross group's encoder tokens)."""

    max_rows: int
    max_tokens: int
    index_capacity: int
    num_groups: int
    slot_rows: tuple[int, ...] = ()
    draft_steps: int = 1  # D: the most steps of a draft round

    def at(self, rows: int, num_rows: int) -> Offsets:
        G, head = self.num_groups, head_offsets(rows, self.num_groups)
        fence = head.fence
        draft = fence + 1 + ((fence + 1) & 1)
        block = 2 * rows * (1 + G)  # one draft step: 2R (int64 slots, 8-byte aligned) + 2GR
        qo = draft + (self.draft_steps - 1) * block
        steps = []
        for j in range(1, self.draft_steps):  # step j's block ends (j - 1) blocks before qo: a round of K steps
            at = qo - j * block               # copies from qo - (K - 1) blocks on
            steps.append((at, tuple((at + 2 * rows * (1 + g), at + 2 * rows * (1 + g) + rows) for g in range(G))))
        groups, at = [], qo + rows + 1
        for g in range(G):
            groups.append((at, at + rows + 1, at + 2 * rows + 1, rows * (1 + g)))
            at += 3 * rows + 1
        slots = at + (at & 1)
        rows_of = [self.slot_rows[g] if g < len(self.slot_rows) else 0 for g in range(G)]
        group_slots, end = [], slots + 2 * num_rows
        for n in rows_of:  # own_pages groups: in the head
            group_slots.append(end if n < 0 else slots)
            end += 2 * num_rows if n < 0 else 0
        tail = end + G * (self.index_capacity + 1)
        tail += tail & 1
        for g, n in enumerate(rows_of):  # cross groups: past the index regions
            if n > 0:
                group_slots[g], tail = tail, tail + 2 * n
        return Offsets(batch_size=rows, num_tokens=num_rows, table_rows=head.table_rows, kv_lens=head.kv_lens,
                       cross_lens=head.cross_lens, updates=head.updates,
                       update_capacity=head.update_capacity, fence=fence, qo=qo, slots=slots,
                       groups=tuple(GroupOffsets(*g, indices=end + i * (self.index_capacity + 1))
                                    for i, g in enumerate(groups)), head_end=end,
                       group_slots=tuple(group_slots), end=tail, draft=draft, draft_steps=tuple(steps))

    @property
    def size(self) -> int:
        """int32 elements of one slot: the layout at the largest (R, N)."""
        return self.at(self.max_rows, self.max_tokens).end


@attrs.frozen
class GroupViews:
    """One layer group's fixed views in a pool slot: int32 device views of kv_indptr [rows+1],
    last_page_len, kv_lens, first_page [rows], pinned host views of the first three, and the group's
    slot_mapping [num_rows or its own count] int64 device."""

    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    first_page: torch.Tensor
    host_kv_indptr: torch.Tensor
    host_last_page_len: torch.Tensor
    host_kv_lens: torch.Tensor
    slot_mapping: torch.Tensor


@attrs.frozen
class SlotViews:
    """A pool slot's fixed views for `rows` requests and `num_rows` token rows: the offsets, qo_indptr
    [rows+1] (device, and pinned host), slot_mapping [num_rows] int64 device, the table rows [rows]
    device, and each layer group's views."""

    offsets: Offsets
    qo_indptr: torch.Tensor
    host_qo_indptr: torch.Tensor
    slot_mapping: torch.Tensor
    table_rows: torch.Tensor
    groups: tuple[GroupViews, ...]


def slot_views(layout: Layout, dev: torch.Tensor, host: torch.Tensor, rows: int, num_rows: int) -> SlotViews:
    """A pool slot's SlotViews for `rows` requests and `num_rows` token rows. dev, host: the slot's
    int32 buffers (device, pinned)."""
    offsets = layout.at(rows, num_rows)
    slots = dev[offsets.slots : offsets.slots + 2 * num_rows].view(torch.int64)
    groups = tuple(GroupViews(
        kv_indptr=dev[o.kv_indptr : o.kv_indptr + rows + 1], last_page_len=dev[o.last_page_len : o.last_page_len + rows],
        kv_lens=dev[o.kv_lens : o.kv_lens + rows], first_page=dev[o.first_page : o.first_page + rows],
        host_kv_indptr=host[o.kv_indptr : o.kv_indptr + rows + 1],
        host_last_page_len=host[o.last_page_len : o.last_page_len + rows], host_kv_lens=host[o.kv_lens : o.kv_lens + rows],
        slot_mapping=slots if at == offsets.slots else dev[at : at + 2 * (n if n > 0 else num_rows)].view(torch.int64))
        for o, at, n in zip(offsets.groups, offsets.group_slots, layout.slot_rows))
    qo = offsets.qo
    return SlotViews(offsets=offsets, qo_indptr=dev[qo : qo + rows + 1], host_qo_indptr=host[qo : qo + rows + 1],
                     slot_mapping=slots, table_rows=dev[offsets.table_rows : offsets.table_rows + rows], groups=groups)
