"""GraphBufferPool: persistent, double-buffered device copies of plans, and the committed step.

State lives here and nowhere else: per slot, one pinned int32 staging buffer and its device twin (laid out by `Layout`),
and each backend's PoolState (FlashInfer wrappers, FA4 page tables) bound to them. `commit(plan)` checks everything
first (a commit that raises changes nothing), stages the plan into the next slot, queues its copies and device work
(bucketed decode steps: derived on the device, derive.py), runs the backend's host scheduling and returns a
`DeviceStep`; a slot's next decode step that differs by its lengths only takes the steady commit (steady.py). Two slots
let the host commit step N+1 while the GPU reads step N; a slot's staging is rewritten only once the copies out of it
have run, which an event recorded at commit proves, or the fence a derived commit's graph writes back (lease.py). All
the pool keeps is bounded by its constructor's arguments: views are cached only for bucketed shapes (slots x buckets
x q_lens), backend states keep one state per slot, group, bucket and q_len (memory_report()).
"""
from __future__ import annotations

import contextlib
import itertools
import warnings

import numpy as np
import torch

from mstar_attn.cache import pool_device
from mstar_attn.capture import checks, cross, derive, rounds
from mstar_attn.capture.layout import SlotViews, slot_views
from mstar_attn.capture.limits import DEFAULT_MAX_PAGES_PER_REQUEST, PoolLimits, limits_of, sizing  # noqa: F401  (re-exported)
from mstar_attn.capture.lease import CurrentStream, SlotLeases, check_slot, check_stream
from mstar_attn.capture.graph_cache import CommitGraphs
from mstar_attn.capture.stage import StagedHead, copy_ranges, listed_entries, stage_derived, stage_pages, stage_requests, stage_rows
from mstar_attn.capture.steady import SteadySlots, SteadyTerms, decode_lists, decode_rows
from mstar_attn.capture.step import DeviceStep, MemoryReport, Slots, StepShape, shapes_of
from mstar_attn.capture.table import PageTable
from mstar_attn.capture.view import PoolView, SizedBounds
from mstar_attn.metadata._arrays import positive_int
from mstar_attn.metadata.backends import BACKENDS, pool_state_class
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan
from mstar_attn.metadata.select import spec_backends
from mstar_attn.metadata.spec import AttentionSpec

FLOAT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-KV scratch, shared by every wrapper of a pool


class GraphBufferPool(SizedBounds):
    """Persistent device buffers for every plan field the backends read, double-buffered.

    spec: the model's AttentionSpec. limits: a PoolLimits, the bounds of every committed step (and so of the
    buffers; see PoolLimits). num_slots: 2 (double buffering); with 1, every commit waits until the copies of the
    one before it have run. float_workspace_bytes: FlashInfer's float workspace (its split-KV partial outputs).
    device: "cuda" (or a CUDA device); "cpu" runs the bookkeeping on the host (tests, the reference backend);
    None: CUDA when torch sees a device, else the CPU. A pool serves every backend its plans name (one PoolState
    per backend module, made ahead). The bounds as keyword arguments (max_batch_size=...) still work, with a
    DeprecationWarning.
    """

    def __init__(self, spec: AttentionSpec, limits: PoolLimits | None = None, *, device: torch.device | str | None = None,
                 num_slots: int = 2, float_workspace_bytes: int = FLOAT_WORKSPACE_BYTES, **bounds):
        if not isinstance(spec, AttentionSpec):
            raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        self.spec, self.limits, self.device = spec, limits_of(limits, bounds), pool_device(device)
        size = self.sizing = sizing(spec, self.limits)  # (its bounds read as the pool's: SizedBounds)
        self.float_workspace_bytes = positive_int("float_workspace_bytes", float_workspace_bytes)
        ps, max_requests = spec.page_size, self.limits.max_requests
        cuda = self.cuda = self.device.type == "cuda"
        slots = positive_int("num_slots", num_slots)
        self.host = [torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=cuda) for _ in range(slots)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = [torch.zeros(self.layout.size, dtype=torch.int32, device=self.device) for _ in range(slots)]
        # each slot's commit count, when its staging may be rewritten, the stream its step runs on
        self.leases = SlotLeases(slots, cuda)
        self.current_stream = CurrentStream(self.device.index) if cuda else None  # the device's current stream, cached
        self.generations = self.leases.generations  # commits per slot: a DeviceStep is live while its count is current
        self.unstaged = [-1] * slots  # the generation of a derived step whose pinned O(rows) arrays are not written yet
        self.held = [StagedHead() for _ in range(slots)]  # what each slot's head holds from its last derived commit
        self._views: dict[tuple, tuple] = {}  # ([kind,] slot, rows, num_rows): views of bucketed steps; ("shape", ...): StepShapes
        self.scratch_slots = spec.scratch_page * ps + np.arange(self.layout.max_tokens, dtype=np.int64) % ps
        self.bytes_to_device = 0  # host-to-device bytes the pool and its backend states issued, all commits
        self.last_commit_bytes = self.next_slot = 0
        # StepRows steps: the page table (a spec with own page lists takes StepBatch steps only; its cross groups may
        # name rows of a cross table), and per bucketed key a CUDA graph of the commit's device work (CommitGraphs)
        self.table = None if max_requests is None or spec.own_page_groups else PageTable(
            spec, max_requests, self.max_pages_per_request, self.device)
        self.cross_table = None if max_requests is None or not spec.has_cross else PageTable(
            spec, max_requests, self.max_pages_per_request, self.device, "cross table")
        self.device_work = CommitGraphs(self.device, slots)  # the commits' device work, one graph per bucketed key
        self.slots = Slots(leases=self.leases, work=self.device_work, device=self.device)  # (what a DeviceStep reads)
        # per slot, its last general decode commit's decisions, for the steady commits after it (steady.py)
        self.steady = SteadySlots(self.slots, self.host_np, self.unstaged, self.held, self.table,
                                  self.layout.index_capacity, self.current_stream, self.cross_table)
        kernel = derive.triton_kernel() if cuda and derive.USE_TRITON else None
        # bucketed decode StepBatch steps (groups on the shared list, or on cross-table rows: derive.cross_pages) are
        # derived too (on CUDA by the Triton kernel only: the torch ops copy a group's whole index region every step)
        xp = derive.cross_pages(spec, self.cross_table)
        self.lists_derived = (not spec.own_page_groups or xp is not None) and (kernel is not None or not cuda)
        self.derivation = None if self.table is None and not self.lists_derived else derive.Derivation(  # (derive.py)
            self.table.dev if self.table is not None else torch.zeros(1, dtype=torch.int32, device=self.device),
            0 if self.table is None else self.table.width, spec.groups, ps, self.layout.index_capacity, kernel, slots, xp)
        self.view = PoolView(spec=spec, sizing=size, device=self.device, host=self.host, dev=self.dev, table=self.table,
                             cross_table=self.cross_table, float_workspace_bytes=self.float_workspace_bytes,
                             upload=self.upload, stage_host=self.stage_host)  # what backends and checks read
        self.backend_states: dict[str, object] = {}  # backend module path -> its PoolState (or None)
        self._by_backend: dict[str, object] = {}  # backend name -> its module's PoolState (or None), once resolved
        self._offsets: dict[tuple[int, int], object] = {}  # (bucket, q_len) -> the layout's Offsets of derived steps
        # every backend a plan for this spec may name, made now: in the memory report from the start, nothing made mid-serving
        for name in spec_backends(spec):
            self.backend_state(name)

    num_slots = property(lambda self: len(self.host), doc="The pool's slots (2: double buffering).")
    stalls = property(lambda self: self.leases.stalls, lambda self, n: setattr(self.leases, "stalls", n),
                      doc="Commits that had to wait for the GPU before reusing a slot.")

    def backend_state(self, backend: str):
        """The PoolState of `backend`'s module for this pool (made once; None for host-only backends)."""
        caps = BACKENDS.get(backend)
        if caps is None:
            raise PlanError(f"backend: unknown backend {backend!r} (known: {sorted(BACKENDS)})")
        if caps.module not in self.backend_states:
            cls = pool_state_class(backend)
            self.backend_states[caps.module] = cls(self.view) if cls is not None else None
        self._by_backend[backend] = self.backend_states[caps.module]
        return self.backend_states[caps.module]

    def scheduler_for(self, backend: str):
        """Deprecated: the backend's per-pool state is `backend_state(backend)` (a PoolState)."""
        warnings.warn("GraphBufferPool.scheduler_for is deprecated: use pool.backend_state(backend)", DeprecationWarning, 2)
        return self.backend_state(backend)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) without blocking, counted in bytes_to_device (backend states use it too)."""
        dst.copy_(src, non_blocking=True)
        self.last_commit_bytes += src.numel() * src.element_size()

    def bucket_for(self, plan: AttentionPlan) -> int | None:
        """The captured batch size serving `plan`, or None when it runs unpadded (see DeviceStep)."""
        return checks.bucket_for(self.view, plan)

    def validate(self, plan: AttentionPlan, draft_ok: bool = False) -> int | None:
        """checks.validate: PlanError unless `plan` fits this pool; returns its bucket (None: unpadded)."""
        return checks.validate(self.view, plan, draft_ok)

    def commit(self, plan: AttentionPlan, *, stream: torch.cuda.Stream | None = None, slot: int | None = None,
               defer: bool = False) -> DeviceStep:
        """Copy `plan` into the next slot (in place, non-blocking) and schedule its backend. No device sync.

        Runs on the caller's current stream, or on `stream`: then the stream that runs the step must call
        `step.wait()` first (see DeviceStep.wait). Every check runs before any state changes: a commit that
        raises PlanError leaves the pool and its live steps as they were. The step of the slot this commit
        reuses (two commits ago with two slots) becomes stale. slot: commit into this slot instead of the
        next one (graph capture does, once per slot). defer: a bucketed StepRows step (or StepBatch decode step listing
        its pages, derive.listed_step) on the current stream whose backend plans nothing on the host leaves its device
        work (table updates, derivations) for its first use: a DecodeGraphs replay runs it as the decode graph's first
        nodes, a first run / write_kv or the next commit launches it (on the commit's stream). A graph of the caller's
        own never launches it: call step.prepare() before capturing one.
        """
        if defer and stream is None and slot is None and (step := self.steady.commit(plan, s := self.next_slot)):
            self.next_slot = (s + 1) % len(self.host)  # (a steady decode step: steady.py; its deferred copy's bytes)
            self.last_commit_bytes = n = self.steady.last_bytes
            self.bytes_to_device += n
            return step
        bucket = checks.validate(self.view, plan)  # the plan's bucket (None: unpadded)
        if stream is not None:
            stream = check_stream(self.device, stream, "commit")
        if slot is not None:
            check_slot(self.num_slots, slot, "commit")
        state = self._by_backend[plan.backend] if plan.backend in self._by_backend else self.backend_state(plan.backend)
        if state is not None:
            state.check(plan, bucket)
        here = self.current_stream() if self.cuda else None
        side = stream if stream is not None and self.cuda and stream != here else None
        if bucket is not None and (plan.rows is not None or self.lists_derived and derive.listed_step(plan) and (
                listed_entries(plan, bucket) <= self.layout.index_capacity) and (  # (its lists staged whole fit)
                self.derivation.cross is None or cross.derivable(plan, self.derivation.cross.group, self.cross_table, state))):
            return self._commit_derived(plan, bucket, state, slot, here, side, defer)  # the device derives its arrays
        return self._commit_staged((plan,), bucket, state, slot, here, side, False)[0]

    def commit_round(self, draft, *, slot: int | None = None) -> tuple[DeviceStep, ...]:
        """Commit all K steps of a DraftRound (build_round) into one slot as one staged commit (one copy per layer group, the
        backend's scheduling of every step): live together until the slot's next commit (rounds.py). Checks first."""
        bucket = rounds.check(self.view, draft)
        check_slot(self.num_slots, slot, "commit_round")
        if (state := self.backend_state(draft.backend)) is not None:
            state.check(draft.steps[-1], bucket)
        return self._commit_staged(draft.steps, bucket, state, slot, self.current_stream() if self.cuda else None, None, True)

    def _commit_staged(self, plans: tuple, bucket: int | None, state, slot: int | None, here, side, round_: bool) -> tuple:
        """The commit of steps whose arrays the host stages (after the checks): a StepBatch step (its page lists, a cross
        group's rows), an unbucketed StepRows step, or a draft round's K steps (sharing the first's page arrays: rounds.py;
        round_: a round). Lease the slot, stage, copy, device work, schedule, event; returns the DeviceSteps."""
        plan, K = plans[0], len(plans)
        slots = None if plan.rows is None else self.table.check_step(plan)  # the last check, O(B + T)
        xg = None if plan.rows is not None else cross.rows_group(plan)  # (CrossRows: StepBatch plans only)
        x_slots = None if xg is None else cross.check(self.cross_table, plan, xg)
        s, lease, B, T = self.free_slot(slot), self.leases, plan.batch_size, plan.num_tokens
        rows, q_len = (bucket, plan.max_q_len) if bucket else (B, 1)
        num_rows = rows * q_len if bucket else T
        views = self.views_of(s, rows, num_rows, bucket is not None)
        self.last_commit_bytes = 0
        table = self.table if xg is None else self.cross_table
        updates = None if plan.rows is None and xg is None else table.take_updates()  # (put back if the commit fails)
        h, offsets, host, dev = self.host_np[s], views.offsets, self.host[s], self.dev[s]
        self.held[s] = StagedHead()  # (these steps write the head in their own layouts: a derived step stages it whole next)
        if plan.rows is None:
            ranges = stage_pages(h, plan, offsets, rows, q_len, num_rows, self.scratch_slots)
            left = 0 if xg is None else cross.stage(h, plan, xg, offsets, rows, x_slots, updates, table)
            if K > 1:  # a round's later steps: their own arrays
                rounds.stage(h, plans, offsets, self.scratch_slots)
        else:
            left = stage_rows(h, plan, offsets, slots, updates, self.table, self.scratch_slots)
            ps, pad = self.spec.page_size, rows - B
            ranges = [(o.indices, o.indices + gp.kv_indptr[-1] + -(-q_len // ps) * pad) for gp, o in zip(plan.groups, offsets.groups)]
        self.generations[s] += 1  # from here on the slot's previous steps are stale
        self.unstaged[s] = -1
        self.next_slot = (s + 1) % len(self.host)
        more = () if K == 1 else self.kept(("draft", s, rows, num_rows), bucket is not None,
                                           lambda: rounds.step_views(self.layout, dev, host, rows, num_rows))
        shapes = shapes_of(s, views, dev, ranges, bucket, q_len, more[: K - 1]) if K > 1 or bucket is None else (
            self._kept_shape(s, bucket, q_len),)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            on = side or here  # the stream this commit's copies and host scheduling run on
            try:
                lease.after_consumer(s, on)
                steps = tuple(DeviceStep.made(p, sh, self.generations[s], self.slots, side) for p, sh in zip(plans, shapes))
                if plan.rows is None:
                    copies = copy_ranges(offsets, ranges, plan)
                    if K > 1:
                        copies[0] = (min(copies[0][0], rounds.first_copy(offsets, K)), copies[0][1])
                    for a, b in copies:
                        self.upload(dev[a:b], host[a:b])
                    if xg is not None:  # the table updates past the step's region, then one graph per bucket
                        self.last_commit_bytes += table.send(updates) if left else 0
                        key, work = self._cross_work(s, views, rows, num_rows, xg)
                        self.device_work.run(key, bucket is not None, work)
                        cross.record(table, plan, xg)
                else:
                    if left:  # more table updates than the step's region holds (admissions): sent first
                        self.last_commit_bytes += table.send(updates)
                    self._rows_device_work(steps[0], state, offsets, False)
                if state is not None:  # (fresh objects no caller has seen yet: set, not rebuilt)
                    scheduled = state.schedule_round(list(steps)) if round_ else (state.schedule(steps[0]),)
                    for st, sch in zip(steps, scheduled):
                        object.__setattr__(st, "scheduled", sch)
                # a step committed on the current stream runs there (until step.wait() names another):
                # a later commit into this slot from another stream must wait for it
                if side is None and here is not None:
                    lease.claim_consumer(s, here, "commit_round" if round_ else "commit")
            except BaseException:
                if updates is not None:  # they may not have reached the device: send them again next time
                    table.restore_updates(updates)
                raise
            finally:
                lease.record(s, on, False)
                self.bytes_to_device += self.last_commit_bytes
        return steps

    def _commit_derived(self, plan: AttentionPlan, bucket: int, state, slot: int | None, here, side,
                        defer: bool) -> DeviceStep:
        """commit for a bucketed StepRows step or listed step (derive.listed_step), after validate and the backend state's
        check: the table check, the rows, lengths and table updates staged (a listed step: lengths, page lists, a cross
        group's rows and lengths), the device work deriving every other array (derive.rows_work) deferred (`defer`) or
        launched. A backend state planning from host arrays (not lazy_host_arrays) gets them staged, after the work."""
        table, lease, q_len, listed = self.table, self.leases, plan.max_q_len, plan.rows is None
        xg = None if not listed or self.derivation.cross is None else self.derivation.cross.group
        if not listed:
            table.check_step(plan, slots=False)  # the last check, O(B)
        elif xg is not None:  # (its cross rows hold what it reads; it stores nothing: cross.derivable)
            cross.check(self.cross_table, plan, xg)
        s = self.free_slot(slot)
        shape = self._kept_shape(s, bucket, q_len)
        offsets = self._offsets[(bucket, q_len)]
        updates = None if listed else table.take_updates()  # (put back if the commit fails)
        h, lazy = self.host_np[s], state is None or state.lazy_host_arrays  # (lazy: no planner reads the host arrays)
        try:
            left, paged = stage_derived(h, plan, offsets, bucket, q_len, updates, table, self.held[s])
            if xg is not None:
                cross.stage_derived(h, plan, xg, offsets, bucket, q_len, self.cross_table.scratch_row)
            h[offsets.fence] = lease.next_fence(s)
            if not lazy:  # the pinned O(rows) arrays, for a backend state that plans from them (else stage_host, if asked)
                stage_requests(h, plan, offsets, bucket, q_len)
        except BaseException:
            if updates is not None:
                table.restore_updates(updates)
            raise
        generation = self.generations[s] = self.generations[s] + 1  # from here on the slot's previous step is stale
        self.unstaged[s] = generation if lazy else -1
        self.next_slot = (s + 1) % len(self.host)
        on, fenced = side or here, False  # the stream this commit's copies and host scheduling run on
        context = None if side is None else torch.cuda.stream(side)
        if context is not None:
            context.__enter__()
        self.last_commit_bytes = 0
        try:
            if here is not None:
                lease.after_consumer(s, on)
            step = DeviceStep.made(plan, shape, generation, self.slots, side)
            self.last_commit_bytes = sent = table.send(updates) if left else 0  # (admissions past the head: sent first)
            if not lazy:
                self._rows_device_work(step, state, offsets, True, paged)
            if state is not None:  # (a fresh object no caller has seen yet: set, not rebuilt)
                object.__setattr__(step, "scheduled", state.schedule(step))
            if lazy:  # (after the backend state's copies: their order does not matter, the arrays are the same)
                # the graph writes back a fence that proves every copy out of the staging ran, unless the
                # backend state planned from it (staged the host arrays) or anything was uploaded
                fenced = side is None and self.unstaged[s] == generation and self.last_commit_bytes == sent
                if defer and fenced:  # (the work left for the step's first use: see commit)
                    key, work = derive.work_key(step, True), lambda st: self._work(st, state, offsets, True)
                    self.device_work.defer(s, generation, key, work, step, on)
                    self.last_commit_bytes += (offsets.draft + paged) * 4
                    if (decode_rows(plan) or decode_lists(plan)) and (
                            terms := SteadyTerms(scheduled=()) if state is None else state.steady(step)):
                        self.steady.record(s, step, terms, key, work, offsets, here)
                else:
                    self._rows_device_work(step, state, offsets, True, paged)
                fenced = fenced and here is not None
            if side is None and here is not None:  # (see commit)
                lease.claim_consumer(s, here, "commit")
        except BaseException:
            if updates is not None:
                table.restore_updates(updates)
            self.device_work.drop(s)  # (a deferred work of this commit: never launched)
            self.steady.drop(s)
            fenced = False
            raise
        finally:
            try:
                lease.record(s, on, fenced)
                self.bytes_to_device += self.last_commit_bytes
            finally:
                if context is not None:
                    context.__exit__(None, None, None)
        return step

    def capture_cross(self, buckets: tuple[int, ...], q_lens: tuple[int, ...]) -> None:
        """Capture (not run) each slot's cross-table device work of these bucketed shapes for every cross group:
        no serving commit naming cross-table rows (CrossRows) captures one then (DecodeGraphs.capture calls this)."""
        groups = [g for g, group in enumerate(self.spec.groups) if group.cross] if self.cross_table is not None else []
        for s, rows, q_len, g in itertools.product(range(self.num_slots), buckets, q_lens, groups):
            self.device_work.prepare(*self._cross_work(s, self.views_of(s, rows, rows * q_len, True), rows, rows * q_len, g))

    def _cross_work(self, s: int, views: SlotViews, rows: int, num_rows: int, g: int) -> tuple:
        """(key, work): group g's cross-table device work (cross.device_work) in slot s for these views."""
        table, dev, cap = self.cross_table, self.dev[s], self.layout.index_capacity
        return ("cross", s, rows, num_rows, g), lambda: cross.device_work(table, dev, views.offsets, g, views.table_rows, cap)

    def _kept_shape(self, s: int, bucket: int, q_len: int) -> StepShape:
        """Slot s's StepShape for `bucket` requests of q_len tokens: each group's whole index region (made once)."""
        shape = self._views.get(("shape", s, bucket, q_len))
        if shape is None:
            views = self.views_of(s, bucket, bucket * q_len, True)
            self._offsets[(bucket, q_len)] = views.offsets
            cap = self.layout.index_capacity
            shape, = shapes_of(s, views, self.dev[s], [(o.indices, o.indices + cap) for o in views.offsets.groups], bucket, q_len)
            self._views[("shape", s, bucket, q_len)] = shape
        return shape

    def _work(self, step: DeviceStep, state, offsets, derived: bool):
        s, fence = step.slot, self.leases.fence_cell(step.slot) if derived and self.cuda else None
        return derive.rows_work(self.derivation, self.dev[s], self.host[s], fence, step, state, offsets, derived)

    def _rows_device_work(self, step: DeviceStep, state, offsets, derived: bool, paged: int = 0) -> None:
        """A StepRows commit's device work (derive.rows_work), launched now: one graph per bucketed key (deferred:
        _commit_derived), one launch. paged: the page ids a derived StepBatch step staged (its work reads them)."""
        key = derive.work_key(step, derived)
        self.device_work.run(key, derived, self._work(step, state, offsets, derived))
        self.last_commit_bytes += ((offsets.draft + paged) if derived else offsets.head_end) * 4  # (what the work reads)

    def stage_host(self, step: DeviceStep) -> None:
        """Write a derived step's O(rows) arrays (stage_requests) into its slot's pinned staging for a backend state
        (lazy_host_arrays) that plans from them on the host; a no-op once staged, or for a stale step."""
        if self.unstaged[step.slot] == step.generation == self.generations[step.slot]:
            stage_requests(self.host_np[step.slot], step.plan, self.layout.at(step.padded_batch_size, step.padded_num_tokens), step.padded_batch_size, step.q_len)
            self.unstaged[step.slot] = -1

    def free_slot(self, slot: int | None, where: str = "commit") -> int:
        """The slot a commit fills, once every deferred device work is launched and its last copies have run."""
        s = self.next_slot if slot is None else slot
        self.steady.drop(s)
        if any(self.device_work.pending):
            self.device_work.launch_all(where)
        self.leases.free(s)
        return s

    def views_of(self, s: int, rows: int, num_rows: int, keep: bool) -> SlotViews:
        """Slot s's fixed views for `rows` requests and `num_rows` token rows (kept for bucketed shapes)."""
        return self.kept((s, rows, num_rows), keep, lambda: slot_views(self.layout, self.dev[s], self.host[s], rows, num_rows))

    def kept(self, key: tuple, keep: bool, make):
        """make()'s views of a slot, made once per key when `keep` (bucketed shapes: bounded), else each time."""
        views = self._views.get(key)
        if views is None and keep:
            views = self._views[key] = make()
        return views if views is not None else make()

    def memory_report(self) -> MemoryReport:
        """Device and pinned bytes this pool and its backend states hold, by component (torch's allocator caches: not listed)."""
        slot_bytes = self.layout.size * 4 * self.num_slots  # (the tables' mirrors and owners, the steady records: pageable)
        parts = {"pool staging (pinned)": (0, slot_bytes if self.cuda else 0), "pool slot buffers": (slot_bytes, 0)}
        for part in (self.table, self.cross_table, self.derivation, self.leases, self.steady, *self.backend_states.values()):
            if part is not None:
                parts.update(part.memory())
        return MemoryReport(parts)
