"""A draft round (metadata/draft.py) as the K-step case of a staged commit (GraphBufferPool.commit_round).

The K steps of a round share their page arrays, so the slot holds them once: step 0 sits where a
decode step would (qo_indptr, each group's kv_indptr, last_page_len, kv_lens, the indices,
slot_mapping), and steps 1..K-1 add only their O(B) arrays (slot_mapping, and per layer group
last_page_len and kv_lens) in the layout's draft region, just ahead of qo_indptr. The pool's one
staged commit transaction (pool.py) stages step 0 like any step and these arrays with `stage`, copies
from the draft region on (`first_copy`), makes the K DeviceSteps over `step_views`, and schedules them
together; all K stay live until the slot is committed again, and all go stale together. This module
holds the round's own parts only: checks, views and staging, pure of the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mstar_attn.capture import checks
from mstar_attn.capture.stage import stage_slots
from mstar_attn.metadata.draft import DraftRound
from mstar_attn.metadata.errors import PlanError

if TYPE_CHECKING:
    from mstar_attn.capture.layout import Layout, Offsets
    from mstar_attn.capture.view import PoolView


def check(pool: PoolView, draft: DraftRound) -> int | None:
    """PlanError unless `draft` is a sealed round this pool holds (its steps within max_draft_steps, a spec
    whose groups share one page list, its last step, which reads the most, within the pool's bounds);
    returns the round's bucket (None: unpadded)."""
    if not isinstance(draft, DraftRound) or not draft.sealed:
        raise PlanError(f"commit_round: expected a DraftRound made by build_round, got {type(draft).__name__}")
    if draft.k > pool.max_draft_steps:
        raise PlanError(f"commit_round: the round has {draft.k} steps; this pool holds rounds of up to "
                        f"{pool.max_draft_steps} (GraphBufferPool(spec, PoolLimits(..., max_draft_steps=...)))")
    if pool.spec.own_page_groups:  # (build_round refuses them; scratch rounds too: this is the pool's own check)
        raise PlanError("commit_round: the pool's spec has layer groups with their own page lists or cross attention; "
                        "draft rounds serve specs whose groups share one page list")
    return checks.validate(pool, draft.steps[-1], draft_ok=True)  # (every step shares the last one's pages)


def step_views(layout: Layout, dev: torch.Tensor, host: torch.Tensor, rows: int, num_rows: int) -> tuple:
    """Per draft step 1..D-1 of a slot (dev, host: its int32 buffers), per layer group: the DeviceGroup fields
    that step holds apart (by name: slot_mapping [num_rows] int64, kv_last_page_len and kv_lens [rows] int32
    device, the same two pinned), what DeviceGroup.over takes as changes."""
    out = []
    for at, groups in layout.at(rows, num_rows).draft_steps:
        slots = dev[at : at + 2 * num_rows].view(torch.int64)
        out.append(tuple(dict(slot_mapping=slots, kv_last_page_len=dev[lpl : lpl + rows], kv_lens=dev[lens : lens + rows],
                              host_last_page_len=host[lpl : lpl + rows], host_kv_lens=host[lens : lens + rows])
                         for lpl, lens in groups))
    return tuple(out)


def stage(h: np.ndarray, plans: tuple, offsets: Offsets, scratch_slots: np.ndarray) -> None:
    """Steps 1..K-1's own arrays into the slot's draft region (h: its pinned staging; step 0 is staged as any
    step is): each step's slot_mapping, and per group its last_page_len and kv_lens; padding requests read and
    write one token of the scratch page."""
    B, rows, num_rows = plans[0].batch_size, offsets.batch_size, offsets.num_tokens
    for plan, (at, groups) in zip(plans[1:], offsets.draft_steps):
        stage_slots(h, offsets, plan.slot_mapping, B, num_rows, scratch_slots, at)
        for gp, (lpl, lens) in zip(plan.groups, groups):
            h[lpl : lpl + B] = gp.kv_last_page_len
            h[lpl + B : lpl + rows] = 1
            h[lens : lens + B] = gp.kv_lens
            h[lens + B : lens + rows] = 1


def first_copy(offsets: Offsets, k: int) -> int:
    """Where a K-step round's copy starts: the draft region of its last step (steps 1..K-1 sit just ahead of
    qo_indptr), or qo_indptr for one step."""
    return offsets.draft_steps[k - 2][0] if k > 1 else offsets.qo
