"""What a pool checks before a commit changes anything: the plan (validate; a stream and a slot: lease.py). Host only.

Each raises PlanError naming the field and the numbers; none changes state. `pool` is the pool's PoolView
(its spec, table, layout, bucket_at, max_verify_q_len and limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar_attn.capture.stage import listed_fits
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan, Mode

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView


def bucket_for(pool: PoolView, plan: AttentionPlan) -> int | None:
    """The captured batch size serving `plan`, or None when it runs unpadded (see DeviceStep)."""
    mode, size = plan.mode, pool.sizing
    if mode is Mode.DECODE or (mode is Mode.VERIFY and plan.max_q_len <= size.max_verify_q_len):
        B, at = plan.batch_size, size.bucket_at
        return at[B] if B < len(at) else None
    return None

def validate(pool: PoolView, plan: AttentionPlan, draft_ok: bool = False) -> int | None:
    """PlanError unless `plan` fits this pool: made by build_plan (hand-edited plans are not
    trusted), for this spec, its batch, tokens and pages within the pool's limits (bucketed
    steps: with their padding, which the layout makes room for)."""
    if not isinstance(plan, AttentionPlan):
        raise PlanError(f"commit: expected an AttentionPlan, got {type(plan).__name__}")
    if plan.draft_step is not None and not draft_ok:
        raise PlanError("commit: this plan is a step of a draft round; commit the round (commit_round)")
    if not plan.sealed:
        raise PlanError("commit: plan was not made by build_plan (an attrs.evolve'd or hand-made plan is not "
                        "checked again); build it with build_plan, or scratch_plan(spec, ..., backend=...)")
    if plan.spec is not pool.spec and plan.spec != pool.spec:
        raise PlanError("commit: the plan was built for another AttentionSpec than this pool's")
    if plan.rows is not None and pool.table is None:
        raise PlanError("commit: a StepRows plan needs a pool with a page table (GraphBufferPool(spec, PoolLimits(..., max_requests=...)))")
    L = pool.sizing.layout
    bucket = bucket_for(pool, plan)
    if plan.batch_size > L.max_rows or plan.num_tokens > (L.max_tokens if bucket else pool.max_num_tokens):
        raise PlanError(f"commit: batch {plan.batch_size} / tokens {plan.num_tokens} exceed the pool's "
                        f"max_batch_size {L.max_rows} / max_num_tokens {pool.max_num_tokens}")
    ps = plan.spec.page_size
    pad = (bucket - plan.batch_size) * -(-plan.max_q_len // ps) if bucket else 0
    if plan.rows is not None and plan.batch_size * -(-plan.max_kv_len // ps) + pad <= L.index_capacity:
        return bucket  # (no group reads more pages than every request reading its longest: no lazy arrays derived)
    if plan.rows is None and plan.lazy and listed_fits(plan, bucket or plan.batch_size, L.index_capacity):
        return bucket  # (a lazy plan that lists its pages: no group reads more than its list or its cross rows, none stores)
    for g, gp in enumerate(plan.groups):
        if gp.stored > pool.max_encoder_tokens:
            raise PlanError(f"commit: group {g} stores {gp.stored} encoder tokens, more than the "
                            f"pool's max_encoder_tokens {pool.max_encoder_tokens}")
        if gp.kv_indptr[-1] + pad > L.index_capacity:
            raise PlanError(f"commit: group {g} reads {gp.kv_indptr[-1]} pages, more than the pool holds "
                            f"(max_num_pages {pool.max_num_pages}, plus room for bucket padding: {L.index_capacity})")
    return bucket
