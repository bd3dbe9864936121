"""Committing a whole draft round (metadata/draft.py) into one pool slot: `commit` (GraphBufferPool.commit_round).

The K steps of a round share their page arrays, so the slot holds them once: step 0 sits where a
decode step would (qo_indptr, each group's kv_indptr, last_page_len, kv_lens, the indices,
slot_mapping), and steps 1..K-1 add only their O(B) arrays (slot_mapping, and per layer group
last_page_len and kv_lens) in the layout's draft region, just ahead of qo_indptr. One non-blocking
copy then moves all K steps of a single-group spec (one more per further layer group, as for any
step), and each backend schedules every step (FlashInfer: one planner call per step and group;
FA4: one page table for the round). The K DeviceSteps share the slot and its generation: all stay
live until the slot is committed again, and all go stale together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar_attn.capture import checks
from mstar_attn.capture.stage import StagedHead, stage_pages, stage_slots
from mstar_attn.capture.step import DeviceGroup, DeviceStep, StepShape
from mstar_attn.metadata.draft import DraftRound
from mstar_attn.metadata.errors import PlanError

if TYPE_CHECKING:
    from mstar_attn.capture.pool import GraphBufferPool


def _step_views(pool: GraphBufferPool, s: int, rows: int, num_rows: int) -> list[tuple[dict, ...]]:
    """Per draft step 1..D-1 of slot s, per layer group: the DeviceGroup fields that step holds apart
    (by name: slot_mapping [num_rows] int64, kv_last_page_len and kv_lens [rows] int32 device, the same
    two pinned), what DeviceGroup.over takes as changes."""
    offsets = pool.layout.at(rows, num_rows)
    dev, host = pool.dev[s], pool.host[s]
    out = []
    for at, groups in offsets.draft_steps:
        slots = dev[at : at + 2 * num_rows].view(torch.int64)
        out.append(tuple(dict(slot_mapping=slots, kv_last_page_len=dev[lpl : lpl + rows], kv_lens=dev[lens : lens + rows],
                              host_last_page_len=host[lpl : lpl + rows], host_kv_lens=host[lens : lens + rows])
                         for lpl, lens in groups))
    return out


def commit(pool: GraphBufferPool, draft: DraftRound, slot: int | None) -> tuple[DeviceStep, ...]:
    """GraphBufferPool.commit_round: every check first, then stage, copy and schedule all K steps.
    Returns K DeviceSteps of one slot and generation (rows: the bucket, or B past the largest)."""
    if not isinstance(draft, DraftRound) or not draft.sealed:
        raise PlanError(f"commit_round: expected a DraftRound made by build_round, got {type(draft).__name__}")
    K = draft.k
    if K > pool.max_draft_steps:
        raise PlanError(f"commit_round: the round has {K} steps; this pool holds rounds of up to {pool.max_draft_steps} "
                        "(GraphBufferPool(spec, PoolLimits(..., max_draft_steps=...)))")
    plans = draft.steps
    if pool.spec.own_page_groups:  # (build_round refuses them; scratch rounds too: this is the pool's own check)
        raise PlanError("commit_round: the pool's spec has layer groups with their own page lists or cross attention; "
                        "draft rounds serve specs whose groups share one page list")
    bucket = checks.validate(pool.view, plans[-1], draft_ok=True)  # (the last step reads the most: every step shares its pages)
    checks.check_slot(pool.num_slots, slot, "commit_round")
    state = pool.backend_state(draft.backend)
    if state is not None:
        state.check(plans[-1], bucket)
    s = pool.free_slot(slot)
    B = draft.batch_size
    rows = num_rows = bucket or B
    views = pool.views_of(s, rows, num_rows, bucket is not None)
    more = pool.kept(("draft", s, rows, num_rows), bucket is not None, lambda: _step_views(pool, s, rows, num_rows))

    h, offsets = pool.host_np[s], views.offsets
    pool.held[s] = StagedHead()  # (a round writes the slot's head in its own layout)
    ranges = stage_pages(h, plans[0], offsets, rows, 1, num_rows, pool.scratch_slots)
    for plan, (at, groups) in zip(plans[1:], offsets.draft_steps):
        stage_slots(h, offsets, plan.slot_mapping, B, num_rows, pool.scratch_slots, at)
        for gp, (lpl, lens) in zip(plan.groups, groups):
            h[lpl : lpl + B] = gp.kv_last_page_len
            h[lpl + B : lpl + rows] = 1  # padding requests: one token of the scratch page
            h[lens : lens + B] = gp.kv_lens
            h[lens + B : lens + rows] = 1
    pool.last_commit_bytes = 0
    pool.generations[s] += 1  # from here on the slot's previous steps are stale
    pool.next_slot = (s + 1) % pool.num_slots
    cuda = pool.device.type == "cuda"
    here = pool.current_stream() if cuda else None
    host, dev = pool.host[s], pool.dev[s]
    try:
        pool.leases.after_consumer(s, here)
        first = offsets.draft_steps[K - 2][0] if K > 1 else offsets.qo
        for a, b in [(first, ranges[0][1])] + list(ranges[1:]):
            pool.upload(dev[a:b], host[a:b])
        indices = [dev[a:b] for a, b in ranges]
        steps = []
        for j, plan in enumerate(plans):
            own = more[j - 1] if j else tuple({} for _ in views.groups)  # (step 0 sits where a decode step would)
            groups = tuple(DeviceGroup.over(g, idx, **changes) for g, idx, changes in zip(views.groups, indices, own))
            slots = own[0]["slot_mapping"] if j else views.slot_mapping
            shape = StepShape(slot=s, padded_batch_size=rows, padded_num_tokens=num_rows, bucket=bucket, q_len=1, qo_indptr=views.qo_indptr,
                              host_qo_indptr=views.host_qo_indptr, slot_mapping=slots, table_rows=views.table_rows,
                              groups=groups)
            steps.append(DeviceStep(plan=plan, shape=shape, generation=pool.generations[s], slots=pool.slots))
        if state is not None:
            scheduled = state.schedule_round(steps)
            for st, sch in zip(steps, scheduled):  # (fresh objects no caller has seen yet: set, not rebuilt)
                object.__setattr__(st, "scheduled", sch)
        if here is not None:
            pool.leases.claim_consumer(s, here, "commit_round")
    finally:
        pool.leases.record(s, here, False)
        pool.bytes_to_device += pool.last_commit_bytes
    return tuple(steps)

