"""Filling a pool slot's pinned staging from a plan, at the offsets `layout.py` gives. Pure numpy writes.

`stage_pages` writes a StepBatch step (its page lists included); `stage_rows` a StepRows step (the
page-table rows instead, and the table entries changed since the last commit); both share the
O(rows) arrays (`stage_requests`) and slot_mapping (`stage_slots`). `stage_derived` writes a
bucketed StepRows step: its rows, lengths and table updates only (the device derives the rest).
"""

from __future__ import annotations

import attrs
import numpy as np

from mstar_attn.capture.layout import Offsets
from mstar_attn.capture.table import PageTable
from mstar_attn.metadata.plan import AttentionPlan


def stage_pages(h: np.ndarray, plan: AttentionPlan, offsets: Offsets, rows: int, q_len: int, num_rows: int,
                scratch_slots: np.ndarray) -> list[tuple[int, int]]:
    """Write a StepBatch step into a slot's staging h. Returns one int32 range per group: group g's
    used index entries (its pages, then the padding requests' scratch entries); group 0's range
    starts at 0, so it also carries every O(rows) array and slot_mapping."""
    B, T, ps = plan.batch_size, plan.num_tokens, plan.spec.page_size
    pad = rows - B
    per = -(-q_len // ps)  # scratch entries per padding request
    stage_requests(h, plan, offsets, rows, q_len)
    ranges = []
    for gp, o in zip(plan.groups, offsets.groups):
        o_idx = o.indices
        n = int(gp.kv_indptr[-1])
        if gp.kv_indices is not None:  # (CrossRows: the device gathers the list, padding included)
            h[o_idx : o_idx + n] = gp.kv_indices
            if pad:  # q_len tokens of the scratch page, read and written by no request
                h[o_idx + n : o_idx + n + per * pad] = plan.spec.scratch_page
        ranges.append((o_idx, o_idx + n + per * pad))
    stage_slots(h, offsets, plan.slot_mapping, T, num_rows, scratch_slots)
    for gp, at in zip(plan.groups, offsets.group_slots):
        if gp.group.cross:  # the encoder tokens stored this step (no padding rows: write_kv takes exactly these)
            if gp.slot_mapping is not None:  # (CrossRows: staged by capture/cross.py)
                n = gp.slot_mapping.shape[0]
                stage_slots(h, offsets, gp.slot_mapping, n, n, scratch_slots, at)
        elif gp.slot_mapping is not None:  # an own_pages group's slots
            stage_slots(h, offsets, gp.slot_mapping, T, num_rows, scratch_slots, at)
    return ranges

def stage_rows(h: np.ndarray, plan: AttentionPlan, offsets: Offsets, slots: np.ndarray, updates: np.ndarray,
               table: PageTable, scratch_slots: np.ndarray) -> int:
    """Write an unbucketed StepRows step (offsets.batch_size = B requests, offsets.num_tokens = T token rows)
    into a slot's staging h: the O(rows) arrays, the table rows, each group's first page,
    slot_mapping, and the table updates. Returns how many updates did not fit the step's region (U):
    the caller sends those directly. (Bucketed StepRows steps: stage_derived.)"""
    B, ps, rows, num_rows = plan.batch_size, plan.spec.page_size, offsets.batch_size, offsets.num_tokens
    stage_requests(h, plan, offsets, rows, 1)
    for gp, o in zip(plan.groups, offsets.groups):
        o_first = o.first_page
        if gp.kv_start is None:
            h[o_first : o_first + rows] = 0
        else:
            np.floor_divide(gp.kv_start, ps, out=h[o_first : o_first + B])
            h[o_first + B : o_first + rows] = 0
    stage_slots(h, offsets, slots, plan.num_tokens, num_rows, scratch_slots)
    return stage_table(h, offsets, plan.rows, rows, updates, table)


@attrs.define
class StagedHead:
    """What one slot's pinned head holds from its last derived commit: the rows (bytes of the table rows,
    the bucket, q_len) and whether its table-update region is all dump lanes; stage_derived rewrites
    only what differs."""

    rows: tuple = ()
    clean: bool = False


def stage_derived(h: np.ndarray, plan: AttentionPlan, offsets: Offsets, rows: int, q_len: int, updates: np.ndarray | None,
                  table: PageTable | None, held: StagedHead) -> tuple[int, int]:
    """Write a bucketed StepRows step into a slot's staging h: the table rows and KV lengths (padding
    requests: the scratch row and q_len tokens) and the table updates, all the device derives the
    step from (capture/derive.py); the rows, padding and an empty update region only when `held` (the
    slot's last derived commit, updated here) did not leave them. A listed step (a StepBatch decode step,
    derive.listed_step; no updates or table): stage_listed, `held` emptied. Returns (how many updates did not fit,
    see stage_table; the page entries a listed step staged)."""
    if plan.rows is None:
        held.rows = ()  # (the head's lengths in another layout: the slot's next StepRows step stages the head whole)
        return 0, stage_listed(h, plan, offsets, rows, q_len, plan.spec.scratch_page)
    B, at = plan.batch_size, offsets.kv_lens
    h[at : at + B] = plan.kv_lens
    key = (table.checked_rows, rows, q_len)  # (the plan's rows, as bytes: commit ran table.check_step on them)
    if key == held.rows and held.clean and not updates.shape[0]:
        return 0, 0
    held.rows = ()  # (until the head is whole again: an exception below leaves no false memo)
    h[at + B : at + rows] = q_len
    left = stage_table(h, offsets, plan.rows, rows, updates, table)
    held.rows, held.clean = key, left > 0 or not updates.shape[0]
    return left, 0


def listed_entries(plan: AttentionPlan, rows: int) -> int:
    """The page entries a listed step (derive.listed_step) of B requests fills padded to `rows`: its lists (n) and one
    scratch page per padding request (decode: q_len 1), what stage_listed stages and a slot's index region must hold."""
    return plan.kv_indices.shape[0] + rows - plan.batch_size


def listed_fits(plan: AttentionPlan, rows: int, capacity: int) -> bool:
    """Whether a lazy listed decode plan (AttentionPlan.lists_decode) padded to `rows` fits a slot's index region of
    `capacity` entries: its lists (listed_entries) and a cross group's pages of cross-table rows (lazy_cross), each
    with one page per padding request. What checks.validate asks of such a plan, and a steady commit of it again."""
    pad, x = rows - plan.batch_size, plan.lazy_cross
    return plan.kv_indices.shape[0] + pad <= capacity and (x is None or x.kv_indptr[-1] + pad <= capacity)


def stage_listed(h: np.ndarray, plan: AttentionPlan, offsets: Offsets, rows: int, q_len: int, scratch_page: int) -> int:
    """Write a bucketed StepBatch decode step whose groups read the shared list (derive.listed_step) into a slot's
    staging h: its KV lengths (padding requests: q_len) in the head, and its exact page lists [n], request after
    request, at group 0's indices (padding requests: one scratch page each), all the device derives the step from
    (capture/derive.py). Returns the page entries staged."""
    B, at = plan.batch_size, offsets.kv_lens
    h[at : at + B] = plan.kv_lens
    h[at + B : at + rows] = q_len
    i0, n, end = offsets.groups[0].indices, plan.kv_indices.shape[0], listed_entries(plan, rows)
    h[i0 : i0 + n] = plan.kv_indices
    h[i0 + n : i0 + end] = scratch_page
    return end


def stage_table(h: np.ndarray, offsets: Offsets, table_rows: np.ndarray, rows: int, updates: np.ndarray,
                table: PageTable) -> int:
    """The requests' table rows [B] (the scratch row for padding requests, up to `rows`) and the
    table entries changed since the last commit (positions, then values; masked lanes name the
    dump) into staging h. Returns how many updates did not fit the step's region (U): then none
    are staged and the caller sends them all directly (`PageTable.send`)."""
    B = table_rows.shape[0]
    h[offsets.table_rows : offsets.table_rows + B] = table_rows
    h[offsets.table_rows + B : offsets.table_rows + rows] = table.scratch_row
    return stage_updates(h, offsets, updates, table)


def stage_updates(h: np.ndarray, offsets: Offsets, updates: np.ndarray, table: PageTable) -> int:
    """The table entries changed since the last commit (updates: [n] int32 flat positions, from
    PageTable.take_updates) into staging h's update region: positions, then their values from the
    table's mirror; the region's other lanes name the dump. Returns n when n is more than the region
    holds (U; then none are staged and the caller sends them all directly), else 0."""
    n, U, at = updates.shape[0], offsets.update_capacity, offsets.updates
    left = n if n > U else 0  # more than the step's region holds (admissions): all go straight to the device
    n = 0 if left else n
    h[at : at + n] = updates[:n]
    h[at + n : at + U] = table.dump
    h[at + U : at + U + n] = table.flat[updates[:n]]
    return left

def stage_requests(h: np.ndarray, plan: AttentionPlan, offsets, rows: int, q_len: int) -> None:
    """qo_indptr and each group's kv_indptr, last_page_len and kv_lens, padding requests included."""
    B, T, ps = plan.batch_size, plan.num_tokens, plan.spec.page_size
    pad, per = rows - B, -(-q_len // ps)
    qo = offsets.qo
    h[qo : qo + B + 1] = plan.qo_indptr
    if pad:
        h[qo + B + 1 : qo + rows + 1] = np.arange(T + q_len, T + q_len * pad + 1, q_len, dtype=np.int32)
    for gp, o in zip(plan.groups, offsets.groups):
        o_ptr, o_lpl, o_len = o.kv_indptr, o.last_page_len, o.kv_lens
        n = gp.kv_indptr[-1]
        h[o_ptr : o_ptr + B + 1] = gp.kv_indptr
        h[o_lpl : o_lpl + B] = gp.kv_last_page_len
        h[o_len : o_len + B] = gp.kv_lens
        if pad:  # q_len tokens of the scratch page, read and written by no request
            h[o_ptr + B + 1 : o_ptr + rows + 1] = np.arange(n + per, n + per * pad + 1, per, dtype=np.int32)
            h[o_lpl + B : o_lpl + rows] = q_len - (per - 1) * ps
            h[o_len + B : o_len + rows] = q_len

def stage_slots(h: np.ndarray, offsets: Offsets, slot_mapping: np.ndarray, T: int, num_rows: int,
                scratch_slots: np.ndarray, at: int | None = None) -> None:
    """slot_mapping [T] int64 into its region (the step's own at offsets.slots, or `at`); padding
    token rows write the scratch page's slots."""
    at = offsets.slots if at is None else at
    wide = h[at : at + 2 * num_rows].view(np.int64)
    wide[:T] = slot_mapping
    if num_rows > T:
        wide[T:num_rows] = scratch_slots[: num_rows - T]


def copy_ranges(offsets: Offsets, ranges: list[tuple[int, int]], plan: AttentionPlan) -> list[tuple[int, int]]:
    """A StepBatch commit's copies: from qo_indptr (from 0 with CrossRows: the rows and table
    updates) through group 0's indices, then each other group's (a CrossRows group's indices
    are gathered on the device instead), then the encoder slots a cross group stores now."""
    gathered = [gp.table_rows is not None for gp in plan.groups]
    start = 0 if any(gathered) else offsets.qo
    out = [(start, offsets.head_end if gathered[0] else ranges[0][1])]
    out += [r for r, skip in zip(ranges[1:], gathered[1:]) if not skip]
    return out + [(at, at + 2 * gp.stored) for gp, at in zip(plan.groups, offsets.group_slots) if gp.stored]
