"""PoolLimits: what bounds the steps a GraphBufferPool commits, and so the memory it holds, as one record."""

from __future__ import annotations

import warnings

import attrs

from mstar_attn.metadata.batch import DEFAULT_BUCKETS
from mstar_attn.metadata.errors import PlanError


@attrs.frozen(kw_only=True)
class PoolLimits:
    """The bounds of a GraphBufferPool (checked by the pool when it is made: PlanError naming the field).

    max_batch_size, max_num_tokens, max_num_pages bound every committed plan: commit raises PlanError
    beyond them (max_num_pages bounds the pages one layer group of one step reads; the buffers also
    hold bucket padding and a whole capture-time scratch plan, so a bucketed step may use that room
    too). buckets: decode / verify batch sizes that captured graphs serve (those above max_batch_size
    are dropped); such a step is padded up to the smallest bucket that holds it.
    max_pages_per_request: the most pages one request may read through a backend that takes a dense
    page table (FlashAttention; commit raises PlanError past it), default 2048 (32k tokens at page
    16): set it to the longest context / page_size. max_requests: give the pool a page table
    (`pool.table`, max_requests rows x max_pages_per_request pages) and take StepRows plans; None:
    StepBatch plans only. max_encoder_tokens: the most encoder tokens one step stores into
    cross-attention groups' pages (default max_num_tokens). max_draft_steps: the most steps of a
    draft round `commit_round` takes (1: none; each further step adds 4 * (2 + 2 * groups) bytes per
    request row to a slot).
    """

    max_batch_size: int
    max_num_tokens: int
    max_num_pages: int
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_pages_per_request: int | None = None
    max_requests: int | None = None
    max_encoder_tokens: int | None = None
    max_draft_steps: int = 1


NAMES = tuple(f.name for f in attrs.fields(PoolLimits))


def limits_of(limits: PoolLimits | None, legacy: dict) -> PoolLimits:
    """`limits`, or one made from the bounds given as keyword arguments of GraphBufferPool (deprecated:
    a DeprecationWarning). PlanError for an unknown keyword, a missing bound, or both forms at once."""
    unknown = sorted(set(legacy) - set(NAMES))
    if unknown:
        raise PlanError(f"GraphBufferPool: unknown arguments {unknown} (the bounds are PoolLimits fields: {list(NAMES)})")
    if limits is not None:
        if legacy:
            raise PlanError(f"GraphBufferPool: bounds given twice: limits= and {sorted(legacy)}")
        if not isinstance(limits, PoolLimits):
            raise PlanError(f"limits: expected a PoolLimits, got {type(limits).__name__}")
        return limits
    missing = [n for n in NAMES[:3] if n not in legacy]
    if missing:
        raise PlanError(f"GraphBufferPool: pass its bounds as GraphBufferPool(spec, PoolLimits(max_batch_size=..., "
                        f"max_num_tokens=..., max_num_pages=...)); missing {missing}")
    warnings.warn("GraphBufferPool(spec, max_batch_size=..., ...) is deprecated: pass the bounds as one record, "
                  "GraphBufferPool(spec, PoolLimits(max_batch_size=..., ...))", DeprecationWarning, stacklevel=3)
    return PoolLimits(**legacy)
