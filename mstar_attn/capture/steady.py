"""The steady decode commit: a slot's next decode step that differs from its last one by its KV lengths only.

While an engine decodes, commit after commit into one slot names the same rows, in the same bucket, for
the same backend, over a page table that changes only by appends (a request starting a page); only the
lengths and those pages move. Every check and decision of the
pool's general transaction then has the same outcome as for that slot's last commit, except those that
read the lengths, and each of those is a per-request range of kv_len:

- the table's (PageTable.check_step): the row holds alone the page its token lands on (an append only
  widens that range: once the table changed by appends alone, the steady commit checks the table's ranges as
  they are now beside the backend state's own: PageTable.holds_decode past SHORT requests, the ranges made
  again once per table change for a shorter batch);
- the backend state's (PoolStateBase.steady): its kept schedule serves these lengths without planning
  (FlashInfer: every request's KV chunk count is the same);
- the pool's (checks.validate): every group's pages fit the slot's index region, one bound on the longest.

So the general commit of such a step leaves a `Steady` record for its slot: what it decided, the backend's
ranges and the bound; beside it the slot keeps the intersection of the table's ranges with the backend's
(SteadySlots.ranges, at the table's change count). The next commit into that slot (two commits later with two
slots) is served from the record when it is a lazy decode plan (build_plan of StepRows.decode) of the
same spec, backend and rows, committed with defer=True on the same current stream, the table changed by
appends alone (PageTable.reshapes: no assign or release since), its pending updates fitting the step's
update region, no slot's step on another stream, no deferred work pending and every length in range. Once
the slot is free (SlotLeases.take waits for it as the general commit does), `SteadySlots.commit` stages the
lengths, the table updates and the fence, and defers the slot's device work exactly as the general commit
would (the device work applies the updates before it reads the table), at a fraction of its host work.
Anything else (a change of rows, an assign or release, a bucket, stream or slot, a length out of range, a
draft, cascade or tree plan, any other plan) takes the general transaction,
which checks everything, raises PlanError where it must, waits where it must, and leaves a new record.

A record is dropped when its slot is committed by the general transaction (GraphBufferPool.free_slot),
so it never outlives what it recorded: the slot's staged head (rows, padding, and its update region, which
the pool's StagedHead says whether empty) and the backend's plans in the slot's workspaces.
`tests/capture/test_steady.py` holds the two paths to the same arrays, table and lease state step by step,
through changes of every kind.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import attrs
import numpy as np

from mstar_attn.capture import cross
from mstar_attn.capture.lease import FENCE_MASK
from mstar_attn.capture.stage import listed_fits, stage_listed, stage_updates
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata._arrays import INT32_MAX, SHORT, Ranges
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan

if TYPE_CHECKING:
    from mstar_attn.capture.layout import Offsets
    from mstar_attn.capture.step import Slots, StepShape
    from mstar_attn.capture.table import PageTable


@attrs.frozen
class SteadyTerms:
    """A backend state's promise for a committed step (PoolStateBase.steady): `scheduled` (its schedule) serves
    every later decode step of the same slot, rows and bucket, committed before anything else goes into that
    slot, whose kv_lens [B] lie in each of `ranges` (metadata/_arrays.Ranges over the B requests; none: any
    lengths) and, a listed step with a cross group of cross-table rows (AttentionPlan.lazy_cross), whose encoder
    lengths [B] lie in `cross` (None: any)."""

    scheduled: tuple
    ranges: tuple = ()
    cross: Ranges | None = None


@attrs.frozen(eq=False)
class Steady:
    """What a slot's last general commit of a decode step decided, for the steady commits after it.

    spec, backend, rows (the step's rows as bytes), table_reshapes (PageTable.reshapes then): what a steady
    step must share with it. max_kv_len: the longest kv_len whose pages fit the slot's index region for
    this batch (checks.validate's bound). promise: the backend state's ranges (SteadyTerms.ranges); the kv_lens
    the table and the promise both accept are the slot's SteadySlots.ranges.
    shape, scheduled: the step's StepShape and schedule. work_key, work: its deferred device
    work's graph key and a function of the step making that work. offsets: where the step sits in the slot
    (layout.Offsets: its lengths, its fence, the head the work copies). stream: the stream it ran on (None: a
    CPU pool) and stream_key, its id (torch's current-stream tuple). cross: whether the step was a listed one with a
    cross group of cross-table rows (AttentionPlan.lazy_cross): a steady step is one too, its encoder lengths in
    cross_ranges (the backend's SteadyTerms.cross; None: any), its cross pages within the slot's index region.
    """

    spec: object
    backend: str
    rows: bytes | None
    table_reshapes: int
    max_kv_len: int
    promise: tuple
    shape: StepShape
    scheduled: tuple
    work_key: tuple
    work: Callable[[DeviceStep], Callable[[], None]]
    offsets: Offsets
    stream: object = None
    stream_key: object = None
    cross: bool = False
    cross_ranges: Ranges | None = None


def decode_rows(plan: AttentionPlan) -> bool:
    """Whether `plan` is a lazy StepRows decode plan (build_plan of StepRows.decode) and nothing else: no draft
    step (those commit as a round), no cascade, no token tree (each of those schedules otherwise)."""
    return plan.lazy and plan.rows is not None and plan.tree is None and plan.draft_step is None and plan.cascade is None


def decode_lists(plan: AttentionPlan) -> bool:
    """Whether `plan` is a lazy decode plan of a StepBatch listing exactly its pages (build_plan's
    AttentionPlan.lists_decode: every group on the shared list, or a cross group of cross-table rows) and nothing else
    (no token tree)."""
    return plan.lazy and plan.rows is None and plan.tree is None and plan.draft_step is None and plan.cascade is None


def allowed(table: PageTable, rows: np.ndarray, promise: tuple) -> Ranges:
    """The kv_lens of a decode step over `rows` that the table (as it is now) and the backend's `promise` (Ranges
    over the same requests) both accept."""
    ranges = table.decode_ranges(rows)
    return intersect((ranges, *promise)) if promise else ranges


def listed_ranges(B: int, promise: tuple) -> Ranges:
    """The kv_lens of a listed decode step of B requests that the backend's `promise` (Ranges over them) accepts: a
    length is at least 1. One promise whose ranges all start at 1 or later is its own answer (no new arrays)."""
    if len(promise) == 1 and promise[0].low.min() >= 1:
        return promise[0]
    return intersect((Ranges(np.ones(B, np.int32), np.full(B, INT32_MAX, np.uint32)), *promise))


def intersect(ranges: tuple) -> Ranges:
    """One Ranges holding exactly the values every one of `ranges` (each over the same B requests) holds."""
    low = np.max([r.low.astype(np.int64) for r in ranges], axis=0)
    high = np.min([r.low.astype(np.int64) + r.span.astype(np.int64) for r in ranges], axis=0)
    return Ranges(low.astype(np.int32), np.maximum(high - low, 0).astype(np.uint32))


class SteadySlots:
    """Per slot of a pool, the Steady record of its last general decode commit (or None), and the steady
    commit. It reads and updates what the general transaction does (the pool's own parts, given at
    construction): the slots' leases and deferred device work (slots: step.Slots), each slot's pinned staging
    (host_np: int32 numpy views), unstaged mark and StagedHead (heads: whether its update region is all dump
    lanes), the page table. capacity: a slot's index region (Layout.index_capacity); current: the pool's
    CurrentStream (None: a CPU pool); cross_table: the pool's (or None). commits: steady commits so far. Holds one
    record per slot (pageable host: the record and its [B] range arrays)."""

    def __init__(self, slots: Slots, host_np: list, unstaged: list, heads: list, table: PageTable | None, capacity: int,
                 current, cross_table: PageTable | None = None):
        self.records: list[Steady | None] = [None] * len(host_np)
        # per slot with a record: (PageTable.changes then, the kv_lens the table and the record's promise then
        # accept), made by the record and again after appends for a batch of at most SHORT requests
        self.ranges: list[tuple[int, Ranges] | None] = [None] * len(host_np)
        self.leases, self.work, self.slots, self.table = slots.leases, slots.work, slots, table
        self.host_np, self.unstaged, self.heads, self.capacity = host_np, unstaged, heads, capacity
        self.cross_table = cross_table
        self.host_ints = [memoryview(h) for h in host_np]  # each slot's staging, its cells written as Python ints
        # the current stream's id: torch's (id, device, type) tuple where it has one, else the Stream
        self.stream_key = (lambda: None) if current is None else (current if current.ident is None else
                                                                  functools.partial(current.ident, current.index))
        self.commits = 0
        self.last_bytes = 0  # bytes the last steady commit left to copy to the device (its head, a listed step's lists)

    def memory(self) -> dict[str, tuple[int, int]]:
        """No device or pinned bytes: the records are pageable host memory (host_bytes())."""
        return {"steady records (pageable host)": (0, 0)}

    def host_bytes(self) -> int:
        """The records' range arrays: per slot two [B] arrays of its ranges, two per backend promise and two for a
        listed step's encoder lengths' ranges (each array counted once: a slot's ranges may be its promise's own)."""
        held = [x for r in self.records if r is not None for x in (*r.promise, r.cross_ranges) if x is not None]
        held += [k[1] for k in self.ranges if k is not None]
        return sum({id(a): a.nbytes for x in held for a in (x.low, x.span)}.values())

    def drop(self, s: int) -> None:
        """Slot s is committed by the general transaction: its record no longer holds."""
        self.records[s] = self.ranges[s] = None

    def record(self, s: int, step: DeviceStep, terms: SteadyTerms, key: tuple, work, offsets: Offsets, stream) -> None:
        """Keep slot s's record after the general commit of a plain decode plan (decode_rows) as `step`, deferred,
        on the current stream `stream` (None: a CPU pool), its table updates staged (its head then holds the rows,
        padding and those updates; the pool's StagedHead says whether any). terms: the backend state's (a host-only
        backend: SteadyTerms(scheduled=())). key, work: the deferred device work's graph key and a function of a step
        making that work; offsets: the step's layout.Offsets."""
        plan, table = step.plan, self.table
        B, ps = plan.batch_size, plan.spec.page_size
        pad = step.shape.padded_batch_size - B
        if plan.rows is None:  # a listed step (decode_lists): no table; the backend's ranges, over these B requests
            self.ranges[s] = (-1, listed_ranges(B, terms.ranges))
        else:
            self.ranges[s] = (table.changes, allowed(table, plan.rows, terms.ranges))
        self.records[s] = Steady(
            spec=plan.spec, backend=plan.backend, rows=None if plan.rows is None else plan.rows.tobytes(),
            table_reshapes=-1 if plan.rows is None else table.reshapes, max_kv_len=(self.capacity - pad) // B * ps,
            promise=terms.ranges, shape=step.shape, scheduled=terms.scheduled, work_key=key, work=work, offsets=offsets,
            stream=stream, stream_key=self.stream_key(),
            cross=plan.lazy_cross is not None, cross_ranges=terms.cross)

    def commit(self, plan: AttentionPlan, s: int) -> DeviceStep | None:
        """Slot s's steady commit of `plan` (GraphBufferPool.commit with defer=True, no stream, no slot), or
        None, nothing changed: the general transaction commits it."""
        b, table = self.records[s], self.table
        if b is None or plan.__class__ is not AttentionPlan:
            return None
        if b.rows is None:
            return self._commit_lists(plan, s, b)
        kv = plan.kv_lens
        if not (plan.sealed and plan.spec is b.spec and plan.backend == b.backend and plan.max_kv_len <= b.max_kv_len
                and decode_rows(plan) and table.reshapes == b.table_reshapes and plan.rows.tobytes() == b.rows
                and not any(self.work.pending) and self.stream_key() == b.stream_key):
            return None
        if table.pending > b.offsets.update_capacity:  # (more updates than the step's update region holds)
            return None
        kept = self.ranges[s]
        if kept[0] == table.changes:  # (a sealed plan's lengths are at least 1, the longest its max_kv_len)
            held = kept[1].holds_from_one(kv, plan.max_kv_len)
        elif kv.shape[0] > SHORT:  # pages appended since (those rows' decode ranges grew): the table's as they are now
            held = table.holds_decode(plan.rows, kv) and all(p.holds(kv) for p in b.promise)
        else:  # (a short batch: its ranges made again once per table change, then checked on Python ints)
            kept = self.ranges[s] = (table.changes, allowed(table, plan.rows, b.promise))
            held = kept[1].holds(kv)
        if not (held and self.leases.take(s, b.stream)):
            return None
        offsets, h = b.offsets, self.host_np[s]
        h[offsets.kv_lens : offsets.kv_lens + kv.shape[0]] = kv
        head = self.heads[s]
        if table.pending or not head.clean:  # (the device work applies the staged updates before it reads the table)
            updates = table.take_updates()
            stage_updates(h, offsets, updates, table)  # (all of them: their count was checked above)
            head.clean = not updates.shape[0]
        return self._deferred(plan, s, b, offsets.draft)

    def _commit_lists(self, plan: AttentionPlan, s: int, b: Steady) -> DeviceStep | None:
        """commit for a slot whose record is of a listed step: the next listed step (decode_lists) of the same
        spec and backend, as many requests (its pages, and a cross group's, within the slot's index region: listed_fits),
        each length in the record's ranges, a cross group's encoder lengths in the record's cross ranges and its rows
        holding them (cross.check; no update pending in them): its lengths and lists staged (stage_listed;
        cross.stage_derived), the fence, the work deferred. The requests may come in another order than the record's
        (an engine's batch order is free) wherever the ranges hold."""
        kv, x, R = plan.kv_lens, plan.lazy_cross, b.shape.padded_batch_size
        if not (plan.sealed and plan.spec is b.spec and plan.backend == b.backend and decode_lists(plan)
                and listed_fits(plan, R, self.capacity) and not any(self.work.pending)
                and self.stream_key() == b.stream_key and self.ranges[s][1].holds_from_one(kv, plan.max_kv_len)
                and (not b.cross if x is None else b.cross and self._cross_ok(plan, b))
                and self.leases.take(s, b.stream)):
            return None
        listed = stage_listed(self.host_np[s], plan, b.offsets, R, 1, plan.spec.scratch_page)
        if x is not None:
            cross.stage_derived(self.host_np[s], plan, plan.spec.own_page_groups[0], b.offsets, R, 1, self.cross_table.scratch_row)
        return self._deferred(plan, s, b, b.offsets.draft + listed)

    def _cross_ok(self, plan: AttentionPlan, b: Steady) -> bool:
        """Whether a listed step's cross group has encoder lengths in b's cross ranges, is one the general commit
        derives (cross.derivable: no update pending in its rows, nothing stored) and its rows hold what it reads
        (cross.check): else the general commit decides, and names what is wrong."""
        x, g = plan.lazy_cross, plan.spec.own_page_groups[0]
        if b.cross_ranges is not None and not b.cross_ranges.holds(x.kv_lens):
            return False
        if self.cross_table is None or not cross.derivable(plan, g, self.cross_table, None):
            return False
        try:
            cross.check(self.cross_table, plan, g)
        except PlanError:
            return False
        return True

    def _deferred(self, plan: AttentionPlan, s: int, b: Steady, staged: int) -> DeviceStep:
        """The end of a steady commit into slot s, its arrays staged (the first `staged` int32 cells of its staging
        are what its device work copies): the fence and the slot's next generation, the step (b's shape and schedule)
        and its device work deferred on b's stream."""
        generations = self.leases.generations
        generation = generations[s] + 1
        self.host_ints[s][b.offsets.fence] = generation & FENCE_MASK
        generations[s] = self.unstaged[s] = generation
        step = DeviceStep.made(plan, b.shape, generation, self.slots, None, b.scheduled)
        self.work.defer(s, generation, b.work_key, b.work, step, b.stream)
        self.commits += 1
        self.last_bytes = staged * 4
        return step
