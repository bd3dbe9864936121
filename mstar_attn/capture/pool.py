"""GraphBufferPool: persistent, double-buffered device copies of plans, and the committed step.

State lives here and nowhere else: per slot, one pinned int32 host staging buffer and its
device twin (both laid out by `_Layout`), plus the backend's scheduler state (FlashInfer
wrappers) bound to that slot's tensors. `commit(plan)` fills the next slot's staging from the
plan's host arrays, issues one non-blocking host-to-device copy, runs the backend's host-side
scheduling, and returns a `DeviceStep`. Two slots let the host commit step N+1 while the GPU
still copies or reads step N; a slot is reused only once the copy out of its staging (and the
backend's own pinned planning buffers) has run, which an event recorded at commit proves.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from mstar_attn.kernels import AUTO, BACKENDS, get_backend
from mstar_attn.metadata.plan import AttentionPlan, Mode
from mstar_attn.metadata.spec import AttentionSpec, PlanError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@attrs.frozen
class _Layout:
    """Offsets (in int32 elements) of every array inside one slot's flat buffer.

    Per group g: indptr [B+1], last_page_len [B], kv_lens [B], indices [P]; shared: qo_indptr
    [B+1]; slots and write_src as int64 (two int32 each) [T]. B = max batch, P = max pages,
    T = max tokens.
    """

    max_batch: int
    max_tokens: int
    max_pages: int
    num_groups: int

    def group(self, g: int) -> tuple[int, int, int, int]:
        b = self.max_batch
        base = (b + 1) + g * (3 * b + 1)
        return base, base + b + 1, base + 2 * b + 1, self.wide + 4 * self.max_tokens + g * self.max_pages

    @property
    def wide(self) -> int:  # start of the int64 region (slot_mapping, write_src), 8-byte aligned
        end = (self.max_batch + 1) + self.num_groups * (3 * self.max_batch + 1)
        return end + (end & 1)

    @property
    def size(self) -> int:
        return self.wide + 4 * self.max_tokens + self.num_groups * self.max_pages


@attrs.frozen
class DeviceGroup:
    """One layer group's committed arrays: device int32 views, and pinned host views of the small ones."""

    kv_indptr: torch.Tensor  # [rows+1] device
    kv_indices: torch.Tensor  # [n] device
    kv_last_page_len: torch.Tensor  # [rows] device
    kv_lens: torch.Tensor  # [rows] device
    host_kv_indptr: torch.Tensor  # [rows+1] pinned CPU
    host_last_page_len: torch.Tensor  # [rows] pinned CPU
    host_kv_lens: torch.Tensor  # [rows] pinned CPU


@attrs.frozen
class DeviceStep:
    """What `run` and `write_kv` read for one committed plan.

    rows: the batch padded to its bucket (or the exact batch past the largest bucket); padded
    requests read one token of page 0 and write nothing. num_rows: token rows q must have
    (rows for decode; plan.num_tokens otherwise). slot_mapping / write_src [num_rows] int64:
    where each row's K/V goes, padding rows copy row 0 onto row 0's slot (same bytes, no race).
    """

    plan: AttentionPlan
    slot: int
    rows: int
    num_rows: int
    bucket: int | None
    qo_indptr: torch.Tensor  # [rows+1] device
    host_qo_indptr: torch.Tensor  # [rows+1] pinned
    slot_mapping: torch.Tensor  # [num_rows] int64 device
    write_src: torch.Tensor  # [num_rows] int64 device
    groups: tuple[DeviceGroup, ...]
    scheduled: tuple = ()  # backend state, one per group (FlashInfer wrappers)

    @property
    def mode(self) -> Mode:
        return self.plan.mode


class GraphBufferPool:
    """Persistent device buffers for every plan field the backends read, double-buffered.

    spec: the model's AttentionSpec; max_batch_size, max_num_tokens, max_num_pages bound every
    committed plan (commit raises PlanError beyond them). buckets: decode batch sizes that
    captured graphs serve; a decode batch is padded up to the smallest bucket that holds it.
    num_slots: 2 (double buffering); 1 makes every commit wait for the GPU to finish the last.
    max_pages_per_request: the most pages one request may read (sizes dense page tables).
    scheduler_options go to every backend Scheduler the pool makes. A pool serves every backend
    its plans name (one Scheduler per backend module, made at the first plan that needs it, or
    all of them up front with `schedulers_for`); spec.backend="auto" lets the plan choose.
    """

    def __init__(self, spec: AttentionSpec, *, max_batch_size: int, max_num_tokens: int, max_num_pages: int,
                 device: torch.device | str = "cuda", buckets: tuple[int, ...] = DEFAULT_BUCKETS, num_slots: int = 2,
                 max_pages_per_request: int | None = None, **scheduler_options):
        self.spec = spec
        self.device = torch.device(device)
        self.buckets = tuple(sorted(b for b in buckets if b <= max_batch_size))
        self.max_num_pages = max_num_pages
        # width of dense page tables (FlashAttention's page_table [rows, width]); None: max_num_pages
        self.max_pages_per_request = min(max_pages_per_request or max_num_pages, max_num_pages)
        # room for one page-0 entry per padded request after the real pages
        self.layout = _Layout(max_batch_size, max(max_num_tokens, max_batch_size), max_num_pages + max(self.buckets, default=0), len(spec.groups))
        self.host = [torch.empty(self.layout.size, dtype=torch.int32, pin_memory=True) for _ in range(num_slots)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = [torch.empty(self.layout.size, dtype=torch.int32, device=self.device) for _ in range(num_slots)]
        self.ready = [None] * num_slots  # event after each slot's last commit: its staging may be rewritten
        self.stalls = 0  # commits that had to wait for the GPU before reusing a slot
        self.next_slot = 0
        self.scheduler_options = scheduler_options
        self.schedulers: dict[str, object] = {}  # backend module path -> its Scheduler (or None)
        if spec.backend != AUTO:
            self.scheduler_for(spec.backend)

    @property
    def num_slots(self) -> int:
        return len(self.host)

    def scheduler_for(self, backend: str):
        """The Scheduler of `backend`'s module for this pool (made once; None for host-only backends)."""
        module = BACKENDS[backend].module
        if module not in self.schedulers:
            mod = get_backend(backend)
            self.schedulers[module] = mod.Scheduler(self, **self.scheduler_options) if hasattr(mod, "Scheduler") else None
        return self.schedulers[module]

    def bucket_for(self, plan: AttentionPlan) -> int | None:
        if plan.mode is not Mode.DECODE:
            return None
        return next((b for b in self.buckets if b >= plan.batch_size), None)

    def commit(self, plan: AttentionPlan, *, slot: int | None = None) -> DeviceStep:
        """Copy `plan` into the next slot (in place, non-blocking) and schedule the backend. No device sync."""
        L = self.layout
        if plan.spec is not self.spec and plan.spec != self.spec:
            raise PlanError("commit: the plan was built for another AttentionSpec than this pool's")
        if plan.batch_size > L.max_batch or plan.num_tokens > L.max_tokens:
            raise PlanError(f"commit: batch {plan.batch_size} / tokens {plan.num_tokens} exceed the pool's "
                            f"max_batch_size {L.max_batch} / max_num_tokens {L.max_tokens}")
        too_many = [g for g, gp in enumerate(plan.groups) if gp.kv_indices.shape[0] > self.max_num_pages]
        if too_many:
            raise PlanError(f"commit: group {too_many[0]} reads {plan.groups[too_many[0]].kv_indices.shape[0]} pages, "
                            f"more than the pool's max_num_pages {self.max_num_pages}")
        s = self.next_slot if slot is None else slot
        self.next_slot = (s + 1) % self.num_slots
        if self.ready[s] is not None and not self.ready[s].query():
            self.stalls += 1
            self.ready[s].synchronize()
        host, dev = self.host[s], self.dev[s]
        h = self.host_np[s]
        B, T = plan.batch_size, plan.num_tokens
        bucket = self.bucket_for(plan)
        rows = bucket or B
        num_rows = rows if plan.mode is Mode.DECODE else T
        pad = rows - B

        h[: B + 1] = plan.qo_indptr
        h[B + 1 : rows + 1] = np.arange(T + 1, T + 1 + pad, dtype=np.int32)
        end = 0
        for g, gp in enumerate(plan.groups):
            o_ptr, o_lpl, o_len, o_idx = L.group(g)
            n = gp.kv_indices.shape[0]
            h[o_ptr : o_ptr + B + 1] = gp.kv_indptr
            h[o_ptr + B + 1 : o_ptr + rows + 1] = np.arange(n + 1, n + 1 + pad, dtype=np.int32)
            h[o_lpl : o_lpl + B] = gp.kv_last_page_len
            h[o_len : o_len + B] = gp.kv_lens
            h[o_lpl + B : o_lpl + rows] = 1  # padding: one token ...
            h[o_len + B : o_len + rows] = 1
            h[o_idx : o_idx + n] = gp.kv_indices
            h[o_idx + n : o_idx + n + pad] = 0  # ... of page 0, read and never written
            end = o_idx + n + pad
        wide = h[L.wide : L.wide + 4 * L.max_tokens].view(np.int64)
        wide[:T] = plan.slot_mapping
        wide[T:num_rows] = plan.slot_mapping[0]
        src = wide[L.max_tokens : L.max_tokens + num_rows]
        src[:T] = np.arange(T)
        src[T:] = 0
        end = max(end, L.wide + 2 * (L.max_tokens + num_rows))
        dev[:end].copy_(host[:end], non_blocking=True)

        groups = []
        for g in range(len(plan.groups)):
            o_ptr, o_lpl, o_len, o_idx = L.group(g)
            n = plan.groups[g].kv_indices.shape[0] + pad
            groups.append(DeviceGroup(
                dev[o_ptr : o_ptr + rows + 1], dev[o_idx : o_idx + n], dev[o_lpl : o_lpl + rows], dev[o_len : o_len + rows],
                host[o_ptr : o_ptr + rows + 1], host[o_lpl : o_lpl + rows], host[o_len : o_len + rows],
            ))
        dwide = dev[L.wide : L.wide + 4 * L.max_tokens].view(torch.int64)
        step = DeviceStep(plan, s, rows, num_rows, bucket, dev[: rows + 1], host[: rows + 1],
                          dwide[:num_rows], dwide[L.max_tokens : L.max_tokens + num_rows], tuple(groups))
        scheduler = self.scheduler_for(plan.backend)
        if scheduler is not None:
            step = attrs.evolve(step, scheduled=scheduler.schedule(step))
        event = torch.cuda.Event()
        event.record()
        self.ready[s] = event
        return step
