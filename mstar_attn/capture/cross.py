"""A commit's cross-attention part when the step names rows of the pool's cross table (CrossRows).

The engine assigns each request's encoder pages to a table row once (`pool.cross_table.assign`,
when its encoder runs); the step then carries O(batch) arrays (rows, encoder lengths, which
requests store their encoder K/V now). `check` proves the rows hold what the step reads and,
for the requests storing, that they hold those pages alone, and derives those tokens' slots from
the host mirror (O(encoder tokens stored), on their first step only). `stage` writes the rows,
the table entries changed since the last commit and the slots into the slot's staging; after the
copy, `device_work` applies the changes to the device table and gathers the group's page list
there. A decode step over known requests so copies no page id (nor any encoder slot) at all: its
cross page list is built on the device from the resident table; what it copies is O(batch).
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn.capture.gather import gather_csr
from mstar_attn.capture.layout import Offsets
from mstar_attn.capture.stage import stage_table
from mstar_attn.capture.table import FREE, PageTable
from mstar_attn.metadata._arrays import SHORT
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan


NO_SLOTS = np.zeros(0, np.int64)  # check's slots for a step storing no encoder tokens
NO_SLOTS.flags.writeable = False


def rows_group(plan: AttentionPlan) -> int | None:
    """The first layer group whose pages are cross-table rows (CrossRows), or None."""
    return next((g for g, gp in enumerate(plan.groups) if gp.table_rows is not None), None)


def check(table: PageTable | None, plan: AttentionPlan, g: int) -> np.ndarray:
    """PlanError unless group g's rows are table rows holding the pages their encoder lengths
    need; each request storing its encoder K/V holds those pages alone (one request per row); and
    each request reading reads exactly what a commit stored in its row (table.stored: a row
    never stored, or a length other than the stored one, is refused). Returns the stored tokens'
    slots [sum(new_lens)] int64, request by request. Changes nothing (`record` does, once the commit ran)."""
    name = f"group_pages[{g}]"
    if table is None:
        raise PlanError(f"commit: {name} names cross-table rows (CrossRows), but this pool has no cross table "
                        "(GraphBufferPool(spec, PoolLimits(..., max_requests=...)) with a cross-attention group in the spec)")
    gp, ps = plan.group_plan(g), plan.spec.page_size
    rows, kv, new = gp.table_rows, gp.kv_lens, gp.new_lens
    if not gp.stored and 0 < rows.shape[0] <= SHORT and _reads_stored(table, rows, kv, ps):
        return NO_SLOTS
    if rows.max() >= table.max_requests:
        i = int(np.flatnonzero(rows >= table.max_requests)[0])
        raise PlanError(f"{name}.rows[{i}]: row {rows[i]} is not a cross-table row (0..{table.max_requests - 1}) (request {i})")
    need = (kv + (ps - 1)) // ps
    short = table.counts[rows] < need
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise PlanError(f"{name}.rows[{i}]: row {rows[i]} holds {table.counts[rows[i]]} pages, fewer than encoder length "
                        f"{kv[i]} needs (request {i})")
    w = new > 0
    stale = ~w & (table.stored[rows] != kv)
    if stale.any():
        i = int(np.flatnonzero(stale)[0])
        held = int(table.stored[rows[i]])
        raise PlanError(f"{name}.kv_lens[{i}]: the step reads {kv[i]} encoder tokens of row {rows[i]}, which holds "
                        + (f"{held} stored" if held else "none stored yet (store them with write=True at the request's "
                           "first step)") + f" (request {i})")
    if not w.any():
        return NO_SLOTS
    writers = rows[w]
    if np.unique(writers).shape[0] != writers.shape[0]:
        raise PlanError(f"{name}.new_lens: two requests store their encoder K/V into the same cross-table row")
    row_t = np.repeat(writers, new[w])
    starts = np.zeros(writers.shape[0] + 1, np.int64)
    np.cumsum(new[w], out=starts[1:])
    pos = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], new[w])
    page, bad = table.written(row_t, pos)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        own = int(table.owner[page[t]])
        why = "shares it read-only" if own < FREE else f"it is held by row {own}"
        raise PlanError(f"{name}.new_lens: row {row_t[t]} would store encoder K/V into page {page[t]}, but {why}")
    return table.slots(page, pos)


def _reads_stored(table: PageTable, rows: np.ndarray, kv: np.ndarray, ps: int) -> bool:
    """check's outcome for a step storing nothing, on Python ints (at most SHORT requests; rows, kv [B] int32 host,
    rows >= 0 as build_plan checked): every row is a table row holding the pages of its request's encoder length and
    exactly that many stored tokens. False: check's numpy path decides (and names what is wrong)."""
    if max(rows.tolist()) >= table.max_requests:
        return False
    return all(c * ps >= k and s == k for c, s, k in zip(table.counts[rows].tolist(), table.stored[rows].tolist(), kv.tolist()))


def record(table: PageTable, plan: AttentionPlan, g: int) -> None:
    """After a commit that stores encoder K/V: their rows now hold that many tokens."""
    gp = plan.groups[g]
    if not gp.stored:
        return
    w = gp.new_lens > 0
    table.stored[gp.table_rows[w]] = gp.kv_lens[w]


def stage(h: np.ndarray, plan: AttentionPlan, g: int, offsets: Offsets, rows: int, slots: np.ndarray,
          updates: np.ndarray, table: PageTable) -> int:
    """Group g's table rows (the scratch row for padding requests), first page 0, the stored
    tokens' slots and the table updates into staging h. Returns how many updates did not fit the
    step's region: the caller sends those directly."""
    o_first = offsets.groups[g].first_page
    h[o_first : o_first + rows] = 0
    at = offsets.group_slots[g]
    h[at : at + 2 * slots.shape[0]].view(np.int64)[:] = slots
    return stage_table(h, offsets, plan.groups[g].table_rows, rows, updates, table)


def derivable(plan: AttentionPlan, g: int, table: PageTable, state) -> bool:
    """Whether the device may derive a bucketed StepBatch decode step's cross group g (capture/derive.py): it names
    rows of the cross table (CrossRows) storing nothing, none with an update pending (the derived commit sends none:
    a later staged commit does, before any step reads those rows), and the backend state's schedule reads no device
    rows (state: a PoolState, or None)."""
    gp = plan.group_plan(g)
    return gp.table_rows is not None and not gp.stored and not (state is not None and state.schedule_reads_rows) \
        and not table.pending_in(gp.table_rows)


def stage_derived(h: np.ndarray, plan: AttentionPlan, g: int, offsets: Offsets, rows: int, q_len: int,
                  scratch_row: int) -> None:
    """A derived StepBatch decode step's cross group g (its rows storing nothing): the requests' table rows at the
    head's table_rows and their encoder lengths at cross_lens (padding requests: the scratch row, q_len tokens), what
    the device derives the group's arrays from (capture/derive.py)."""
    gp, B = plan.group_plan(g), plan.batch_size
    h[offsets.table_rows : offsets.table_rows + B] = gp.table_rows
    h[offsets.table_rows + B : offsets.table_rows + rows] = scratch_row
    h[offsets.cross_lens : offsets.cross_lens + B] = gp.kv_lens
    h[offsets.cross_lens + B : offsets.cross_lens + rows] = q_len


def device_work(table: PageTable, dev: torch.Tensor, offsets: Offsets, g: int, table_rows: torch.Tensor,
                capacity: int) -> None:
    """After the slot's copy (same stream): the staged table updates (masked lanes to the dump), then
    group g's page list gathered from the table. Device ops only, sizes fixed by the step's shape:
    the pool captures it once per slot and bucket and replays it."""
    at, U = offsets.updates, offsets.update_capacity
    table.dev.index_copy_(0, dev[at : at + U].long(), dev[at + U : at + 2 * U])
    gather_csr(table.dev, table.width, table_rows, dev, [offsets.groups[g]], capacity)
