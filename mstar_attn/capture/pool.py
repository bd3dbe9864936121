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
DEFAULT_MAX_PAGES_PER_REQUEST = 2048


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

    rows: the batch padded to its bucket (or the exact batch past the largest bucket). Bucketed
    steps are decode steps and verify steps whose q_len (the same for every request) is at most
    page_size; q_len is 1 for decode. A padded request has q_len tokens, reads q_len tokens of
    page 0 (kv_len = q_len: the sequence-length fill value) and writes nothing of its own.
    num_rows: token rows q must have (rows * q_len when bucketed; plan.num_tokens otherwise).
    slot_mapping / write_src [num_rows] int64: where each row's K/V goes; padding rows copy row
    0 onto row 0's slot (the same bytes, so no race and no other page touched).
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
    q_len: int = 1  # new tokens per request of a bucketed step
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
    max_pages_per_request: the most pages one request may read through a backend that takes a
    dense page table (FlashAttention; commit raises PlanError past it). Default 2048 (32k tokens
    at page 16); set it to the longest context / page_size.
    scheduler_options go to every backend Scheduler the pool makes. A pool serves every backend
    its plans name (one Scheduler per backend module, made at the first plan that needs it, or
    made ahead with `scheduler_for`); spec.backend="auto" lets the plan choose.
    """

    def __init__(self, spec: AttentionSpec, *, max_batch_size: int, max_num_tokens: int, max_num_pages: int,
                 device: torch.device | str = "cuda", buckets: tuple[int, ...] = DEFAULT_BUCKETS, num_slots: int = 2,
                 max_pages_per_request: int | None = None, **scheduler_options):
        self.spec = spec
        self.device = torch.device(device)
        self.buckets = tuple(sorted(b for b in buckets if b <= max_batch_size))
        self.max_num_pages = max_num_pages
        # width of dense page tables (FlashAttention's page_table [rows, width])
        self.max_pages_per_request = min(max_pages_per_request or DEFAULT_MAX_PAGES_PER_REQUEST, max_num_pages)
        # room for one page-0 entry per padded request after the real pages, and for padded
        # verify rows (bucket * page_size tokens at most)
        max_rows = max(self.buckets, default=0) * spec.page_size
        self.layout = _Layout(max_batch_size, max(max_num_tokens, max_batch_size, max_rows), max_num_pages + max(self.buckets, default=0), len(spec.groups))
        self.offsets = tuple(self.layout.group(g) for g in range(len(spec.groups)))  # per group, fixed
        self.wide = self.layout.wide
        self.verify_buckets = all(g.causal for g in spec.groups)  # verify steps can be bucketed
        self.host = [torch.empty(self.layout.size, dtype=torch.int32, pin_memory=True) for _ in range(num_slots)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = [torch.empty(self.layout.size, dtype=torch.int32, device=self.device) for _ in range(num_slots)]
        # recorded after each slot's commit: once it has run, the slot's staging may be rewritten
        self.ready = [torch.cuda.Event() for _ in range(num_slots)]
        self._views: dict[tuple, tuple] = {}  # (slot, rows, num_rows) -> fixed-size tensor views
        self.arange_rows = np.arange(self.layout.max_tokens, dtype=np.int64)
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
        """The captured batch size serving `plan`, or None when it runs eagerly (see DeviceStep)."""
        if plan.mode is not Mode.DECODE and not (
                plan.mode is Mode.VERIFY and self.verify_buckets and plan.max_q_len <= self.spec.page_size):
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
        if not self.ready[s].query():
            self.stalls += 1
            self.ready[s].synchronize()
        h = self.host_np[s]
        B, T = plan.batch_size, plan.num_tokens
        bucket = self.bucket_for(plan)
        rows = bucket or B
        q_len = plan.max_q_len if bucket else 1
        num_rows = rows * q_len if bucket else T
        pad = rows - B

        h[: B + 1] = plan.qo_indptr
        if pad:
            h[B + 1 : rows + 1] = np.arange(T + q_len, T + q_len * pad + 1, q_len, dtype=np.int32)
        end = 0
        for gp, (o_ptr, o_lpl, o_len, o_idx) in zip(plan.groups, self.offsets):
            n = gp.kv_indices.shape[0]
            h[o_ptr : o_ptr + B + 1] = gp.kv_indptr
            h[o_lpl : o_lpl + B] = gp.kv_last_page_len
            h[o_len : o_len + B] = gp.kv_lens
            h[o_idx : o_idx + n] = gp.kv_indices
            if pad:  # q_len tokens of page 0, read and never written
                h[o_ptr + B + 1 : o_ptr + rows + 1] = np.arange(n + 1, n + 1 + pad, dtype=np.int32)
                h[o_lpl + B : o_lpl + rows] = q_len
                h[o_len + B : o_len + rows] = q_len
                h[o_idx + n : o_idx + n + pad] = 0
            end = o_idx + n + pad
        wide = h[self.wide : self.wide + 4 * L.max_tokens].view(np.int64)
        wide[:T] = plan.slot_mapping
        src = wide[L.max_tokens : L.max_tokens + num_rows]
        src[:T] = self.arange_rows[:T]
        if num_rows > T:
            wide[T:num_rows] = plan.slot_mapping[0]
            src[T:] = 0
        end = max(end, self.wide + 2 * (L.max_tokens + num_rows))
        self.dev[s][:end].copy_(self.host[s][:end], non_blocking=True)

        v = self._views.get((s, rows, num_rows))
        if v is None:
            v = self._views[(s, rows, num_rows)] = self._make_views(s, rows, num_rows)
        dev = self.dev[s]
        groups = tuple([
            DeviceGroup(ptr, dev[o_idx : o_idx + gp.kv_indices.shape[0] + pad], lpl, lens, h_ptr, h_lpl, h_lens)
            for gp, (ptr, lpl, lens, h_ptr, h_lpl, h_lens), (_, _, _, o_idx) in zip(plan.groups, v[4], self.offsets)
        ])
        fields = (plan, s, rows, num_rows, bucket, v[0], v[1], v[2], v[3], groups, q_len)
        step = DeviceStep(*fields)
        scheduler = self.scheduler_for(plan.backend)
        if scheduler is not None:  # (a second constructor call is cheaper than attrs.evolve)
            step = DeviceStep(*fields, scheduler.schedule(step))
        self.ready[s].record()
        return step

    def _make_views(self, s: int, rows: int, num_rows: int) -> tuple:
        """Slot s's fixed-size views for `rows` requests and `num_rows` token rows (made once)."""
        L, dev, host = self.layout, self.dev[s], self.host[s]
        groups = []
        for o_ptr, o_lpl, o_len, _ in self.offsets:
            groups.append((dev[o_ptr : o_ptr + rows + 1], dev[o_lpl : o_lpl + rows], dev[o_len : o_len + rows],
                           host[o_ptr : o_ptr + rows + 1], host[o_lpl : o_lpl + rows], host[o_len : o_len + rows]))
        dwide = dev[self.wide : self.wide + 4 * L.max_tokens].view(torch.int64)
        return (dev[: rows + 1], host[: rows + 1], dwide[:num_rows],
                dwide[L.max_tokens : L.max_tokens + num_rows], tuple(groups))
