"""The committed step the backends read (`DeviceStep`), and the pool's memory report."""

from __future__ import annotations

import operator
import warnings
from typing import TYPE_CHECKING

import attrs
import torch

from mstar_attn.capture.lease import HostEvent, check_stream  # noqa: F401  (HostEvent: a kept name)
from mstar_attn.metadata.errors import PlanError, StaleStepError
from mstar_attn.metadata.plan import AttentionPlan, Mode

if TYPE_CHECKING:
    from mstar_attn.capture.graph_cache import CommitGraphs
    from mstar_attn.capture.layout import GroupViews, SlotViews
    from mstar_attn.capture.lease import SlotLeases


def deprecated_alias(old: str, new: str):
    """A read-only property `old` that warns and reads `new` (a renamed field, kept for callers of the old name)."""
    def read(self):
        warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, 2)
        return getattr(self, new)
    return property(read, doc=f"deprecated: {new}")


@attrs.frozen
class DeviceGroup:
    """One layer group's committed arrays: int32 device views, and pinned host views of the small ones."""

    kv_indptr: torch.Tensor  # [padded_batch_size+1] device
    kv_indices: torch.Tensor  # device: a bucketed step's whole index region (the first kv_indptr[-1] are the step's), else [n]
    kv_last_page_len: torch.Tensor  # [padded_batch_size] device
    kv_lens: torch.Tensor  # [padded_batch_size] device
    first_page: torch.Tensor  # [padded_batch_size] device: the first table column a StepRows step's group reads
    host_kv_indptr: torch.Tensor  # [padded_batch_size+1] pinned CPU
    host_last_page_len: torch.Tensor  # [padded_batch_size] pinned CPU
    host_kv_lens: torch.Tensor  # [padded_batch_size] pinned CPU
    slot_mapping: torch.Tensor  # [padded_num_tokens] int64 device: where the group's layers write (the step's
    # slot_mapping itself, unless the group keeps its own page list: LayerGroup.own_pages)

    def listed(self) -> torch.Tensor:
        """The step's page ids on the device, padding requests' included: kv_indices' first host_kv_indptr[-1]
        entries (a view; reads the pinned host_kv_indptr, which a planner reading host arrays has staged)."""
        return self.kv_indices[: int(self.host_kv_indptr[-1])]

    @classmethod
    def over(cls, views: GroupViews, kv_indices: torch.Tensor, **changes: torch.Tensor) -> DeviceGroup:
        """The group's arrays: its slot views (layout.GroupViews) with `kv_indices`; `changes` replace fields
        by name (a draft step's own kv_last_page_len, kv_lens, host_last_page_len, host_kv_lens, slot_mapping)."""
        fields = dict(kv_indptr=views.kv_indptr, kv_indices=kv_indices, kv_last_page_len=views.last_page_len,
                      kv_lens=views.kv_lens, first_page=views.first_page, host_kv_indptr=views.host_kv_indptr,
                      host_last_page_len=views.host_last_page_len, host_kv_lens=views.host_kv_lens,
                      slot_mapping=views.slot_mapping)
        fields.update(changes)
        return cls(**fields)


@attrs.frozen
class StepShape:
    """What every step committed into one pool slot at one shape shares: its views into the slot.

    slot: the pool slot. padded_batch_size: the requests of the step padded to its bucket (or the exact
    batch for steps no bucket serves). Bucketed steps are decode and verify steps; q_len is their tokens per request (1 for
    decode). A padded request has q_len tokens, reads q_len tokens of the scratch page and writes
    its token rows there: no request's page is touched. padded_num_tokens: token rows of the step, the
    rows q, k and v have in a captured graph (padded_batch_size * q_len when bucketed; plan.num_tokens
    otherwise). slot_mapping [padded_num_tokens] int64 device: where each
    row's K/V goes (groups[g].slot_mapping for a group with its own page list). A pool keeps one per
    (slot, bucket, q_len) for bucketed steps (each group over its whole index region) and makes one per
    commit for every other step (the K steps of a draft round, unbucketed steps).
    """

    slot: int
    padded_batch_size: int
    padded_num_tokens: int
    bucket: int | None
    q_len: int
    qo_indptr: torch.Tensor  # [padded_batch_size+1] device
    host_qo_indptr: torch.Tensor  # [padded_batch_size+1] pinned
    slot_mapping: torch.Tensor  # [padded_num_tokens] int64 device
    table_rows: torch.Tensor  # [padded_batch_size] device: a StepRows step's page-table rows (padding: the scratch row)
    groups: tuple[DeviceGroup, ...]

    rows = deprecated_alias("StepShape.rows", "padded_batch_size")
    num_rows = deprecated_alias("StepShape.num_rows", "padded_num_tokens")


def shapes_of(slot: int, views: SlotViews, buf: torch.Tensor, ranges, bucket: int | None, q_len: int,
              changes: tuple = ()) -> tuple[StepShape, ...]:
    """The StepShapes of a commit into `slot` at views' shape (views: layout.SlotViews; buf: the slot's int32 device
    buffer): each layer group over its index range ranges[g] = (start, end) in buf. changes: for the steps of a draft
    round after its first, per step and group the DeviceGroup fields that step holds apart (rounds.step_views);
    returns one shape per step (one without changes)."""
    o, idx = views.offsets, [buf[a:b] for a, b in ranges]

    def shape(groups, slot_mapping) -> StepShape:
        return StepShape(slot=slot, padded_batch_size=o.batch_size, padded_num_tokens=o.num_tokens, bucket=bucket,
                         q_len=q_len, qo_indptr=views.qo_indptr, host_qo_indptr=views.host_qo_indptr,
                         slot_mapping=slot_mapping, table_rows=views.table_rows, groups=groups)

    first = shape(tuple(DeviceGroup.over(g, i) for g, i in zip(views.groups, idx)), views.slot_mapping)
    return (first, *(shape(tuple(DeviceGroup.over(g, i, **c) for g, i, c in zip(views.groups, idx, own)),
                           own[0]["slot_mapping"]) for own in changes))


@attrs.frozen(eq=False)
class Slots:
    """What a committed step reads of its pool, made once by the pool: the slots' leases (their commit counts,
    events and consumer streams), the commits' deferred device work, and the device. A DeviceStep holds this,
    not the pool: the pool makes steps; a step never reaches back into it."""

    leases: SlotLeases
    work: CommitGraphs
    device: torch.device


def forwarded(owner: str, name: str, doc: str) -> property:
    """A read-only property reading field `name` of the record the object holds as `owner` (one C attribute
    getter: these are read on the per-step path)."""
    return property(operator.attrgetter(f"{owner}.{name}"), doc=doc)


def _shape_field(name: str, doc: str) -> property:
    return forwarded("shape", name, doc)


@attrs.frozen(slots=False)  # (instance dicts: see made)
class DeviceStep:
    """What `run` and `write_kv` read for one committed plan, valid until its slot is committed again.

    shape: the slot, padded sizes and views it reads (StepShape); its fields read as the step's own
    (step.padded_batch_size, step.groups, ...).
    generation: the pool slot's commit count when this step was made; once the slot is committed
    again the step is stale and every backend refuses it (StaleStepError).
    stream: the side stream it was committed on, or None (the caller's current stream): then the
    stream that runs it must `wait()` first, and backends refuse it until it has.
    """

    plan: AttentionPlan
    shape: StepShape
    generation: int
    slots: Slots = attrs.field(eq=False, repr=False)
    stream: torch.cuda.Stream | None = attrs.field(default=None, eq=False, repr=False)
    scheduled: tuple = attrs.field(default=(), eq=False, repr=False)  # backend state, one per group
    # [waited (on the stream that runs it), the caches a write_kv stored into (their K data pointers)]: host facts
    _flags: list = attrs.field(factory=lambda: [False, set()], eq=False, repr=False, alias="_flags")

    @classmethod
    def made(cls, plan: AttentionPlan, shape: StepShape, generation: int, slots: Slots,
             stream: torch.cuda.Stream | None = None, scheduled: tuple = ()) -> DeviceStep:
        """The step __init__ makes of these arguments with the other fields' defaults: the per-step path's
        constructor, one dict write instead of a call per field (tests/capture/test_step.py)."""
        step = object.__new__(cls)
        step.__dict__.update(plan=plan, shape=shape, generation=generation, slots=slots, stream=stream,
                             scheduled=scheduled, _flags=[False, set()])
        return step

    slot = _shape_field("slot", "the pool slot (StepShape)")
    padded_batch_size = _shape_field("padded_batch_size", "requests, padding included (StepShape)")
    padded_num_tokens = _shape_field("padded_num_tokens", "token rows, padding included (StepShape)")
    rows = deprecated_alias("DeviceStep.rows", "padded_batch_size")
    num_rows = deprecated_alias("DeviceStep.num_rows", "padded_num_tokens")
    bucket = _shape_field("bucket", "the captured batch size serving the step, or None (StepShape)")
    q_len = _shape_field("q_len", "tokens per request of a bucketed step (StepShape)")
    qo_indptr = _shape_field("qo_indptr", "[padded_batch_size+1] int32 device")
    host_qo_indptr = _shape_field("host_qo_indptr", "[padded_batch_size+1] int32 pinned")
    slot_mapping = _shape_field("slot_mapping", "[padded_num_tokens] int64 device")
    table_rows = _shape_field("table_rows", "[padded_batch_size] int32 device: a StepRows step's page-table rows")
    groups = _shape_field("groups", "tuple[DeviceGroup, ...], one per layer group")

    @property
    def kv_stored(self) -> bool:
        """Whether a write_kv has stored new K/V of this step (any layer's cache), as host code. A replayed
        graph's write_kv sets nothing (such a step's run is in the graph too)."""
        return bool(self._flags[1])

    def stored_in(self, cache) -> bool:
        """Whether a write_kv has stored new K/V of this step into `cache` (a PagedKVCache): what run's
        misuse check reads, per layer's cache."""
        stored = self._flags[1]
        return cache.k.data_ptr() in stored or None in stored

    def mark_stored(self, cache=None) -> None:
        """Called by every backend's write_kv on a committed step, with the cache it stored into; by an
        engine that stored the step's K/V in `cache` with its own kernel. None: every cache counts as
        stored (graph capture's scratch steps, whose K/V values do not matter)."""
        self._flags[1].add(None if cache is None else cache.k.data_ptr())

    @property
    def mode(self) -> Mode:
        return self.plan.mode

    @property
    def live(self) -> bool:
        """False once the slot has been committed again (this step's buffers hold another step)."""
        return self.slots.leases.generations[self.slot] == self.generation

    def check(self, where: str, launch: bool = True) -> None:
        """StaleStepError if stale; PlanError if committed on a side stream and not waited for. O(1).
        With `launch`, the step's deferred device work (commit(defer=True)) is launched first if it
        has not been (every backend's run and write_kv check their step so)."""
        work, generations = self.slots.work, self.slots.leases.generations
        if launch and work.pending[self.slot] is not None and generations[self.slot] == self.generation:
            work.launch(self.slot, where)
        if generations[self.slot] != self.generation:
            raise StaleStepError(f"{where}: this step is stale: pool slot {self.slot} has been committed again since "
                                 f"(commit {self.generation} of that slot, now {generations[self.slot]}); "
                                 "use the step the latest commit returned")
        if self.stream is not None and not self._flags[0]:
            raise PlanError(f"{where}: this step was committed on a side stream; call step.wait() on the stream that "
                            "runs it first, so its kernels cannot read the buffers before the copy lands")

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait on the GPU for this step's copies and
        host-side scheduling copies; no host sync. Run the step on that stream: the pool makes the
        next commit into this slot wait for the work queued there so far, so it cannot overwrite
        buffers a queued kernel still reads. (A step committed without `stream=` runs on the stream
        that committed it, and needs no wait.) All of a pool's live steps run on one stream: a
        step of the other slot running elsewhere raises PlanError (see SlotLeases.claim_consumer)."""
        self.check_live("wait")
        slots = self.slots
        stream = check_stream(slots.device, stream, "wait")
        if slots.work.pending_key(self.slot, self.generation) is not None:  # (on the commit's stream: the
            slots.work.launch(self.slot, "wait")  # event below follows it)
        if slots.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(slots.device.index)
            if self._flags[0] and slots.leases.consumers[self.slot] not in (None, stream):
                raise PlanError("wait: this step was already waited for on another stream; a step runs on one stream")
            slots.leases.claim_consumer(self.slot, stream, "wait")
            stream.wait_event(slots.leases.event_of(self.slot))
        self._flags[0] = True

    def prepare(self) -> None:
        """Launch this step's deferred device work (commit(defer=True)) now, on its commit's stream, if it
        has not been: before capturing or replaying a CUDA graph of your own over the step. A no-op otherwise."""
        self.check_live("prepare")
        if self.slots.work.pending_key(self.slot, self.generation) is not None:
            self.slots.work.launch(self.slot, "prepare")

    def check_live(self, where: str) -> None:
        if not self.live:
            self.check(where)

    def accepts_rows(self, n: int) -> bool:
        """Whether q (or k, v) may have n rows: the step's tokens, or for a bucketed step any
        b * q_len with plan.batch_size <= b <= padded_batch_size (padding requests' rows included)."""
        if n == self.plan.num_tokens:
            return True
        if self.bucket is None:
            return False
        b, extra = divmod(n, self.q_len)
        return not extra and self.plan.batch_size <= b <= self.padded_batch_size

    def rows_expected(self) -> str:
        if self.bucket is None:
            return f"{self.plan.num_tokens}"
        return f"{self.plan.num_tokens} or b * {self.q_len} for b in {self.plan.batch_size}..{self.padded_batch_size}"


@attrs.frozen
class MemoryReport:
    """Bytes a pool holds, by component: name -> (device bytes, pinned host bytes)."""

    components: dict

    @property
    def device(self) -> int:
        return sum(d for d, _ in self.components.values())

    @property
    def pinned(self) -> int:
        return sum(p for _, p in self.components.values())

    def __str__(self) -> str:
        rows = [f"{name:<28} device {d / 2**20:9.2f} MiB  pinned {p / 2**20:9.2f} MiB"
                for name, (d, p) in self.components.items()]
        rows.append(f"{'total':<28} device {self.device / 2**20:9.2f} MiB  pinned {self.pinned / 2**20:9.2f} MiB")
        return "\n".join(rows)
