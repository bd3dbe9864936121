"""PoolLimits: what bounds the steps a GraphBufferPool commits, and so the memory it holds, as one record;
and `Sizing`, what a pool lays its buffers out for, checked and derived from a spec and its limits."""

from __future__ import annotations

import warnings

import attrs

from mstar_attn.capture.layout import Layout
from mstar_attn.metadata._arrays import positive_int
from mstar_attn.metadata.batch import DEFAULT_BUCKETS, bucket_of
from mstar_attn.metadata.draft import MAX_DRAFT_STEPS
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.backends import AUTO, BACKENDS
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, check_tree_spec
from mstar_attn.metadata.spec import AttentionSpec
from mstar_attn.metadata.tree import MAX_TREE_NODES

DEFAULT_MAX_PAGES_PER_REQUEST = 2048


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
    request row to a slot). max_tree_nodes: the largest tree size a bucketed (graph-replayable) token-tree
    verify step holds, MAX_VERIFY_Q_LEN (16, the default) .. MAX_TREE_NODES (64); larger trees run
    unbucketed. Past 16 the slots hold the largest bucket x max_tree_nodes token rows.
    """

    max_batch_size: int
    max_num_tokens: int
    max_num_pages: int
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_pages_per_request: int | None = None
    max_requests: int | None = None
    max_encoder_tokens: int | None = None
    max_draft_steps: int = 1
    max_tree_nodes: int = MAX_VERIFY_Q_LEN


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


@attrs.frozen(kw_only=True)
class Sizing:
    """A pool's checked bounds (PoolLimits) and what follows from them for its spec: the buckets
    (ascending, within max_batch_size) and bucket_at (batch size 0..largest bucket -> the bucket
    serving it; entry 0, never asked for, is the smallest bucket), whether verify steps are bucketed
    (every group causal) and up to which q_len (max_verify_q_len: 16, or max_tree_nodes for token-tree
    steps; 1 when not bucketed), and the slot Layout, with room for padding requests and a whole
    capture-time scratch plan or round."""

    max_batch_size: int
    max_num_tokens: int
    max_num_pages: int
    max_encoder_tokens: int
    max_pages_per_request: int
    max_draft_steps: int
    buckets: tuple[int, ...]
    bucket_at: tuple
    max_verify_q_len: int
    layout: Layout

    @property
    def verify_buckets(self) -> bool:
        """Whether verify steps are bucketed (every group causal): max_verify_q_len past 1."""
        return self.max_verify_q_len > 1


def sizing(spec: AttentionSpec, lim: PoolLimits) -> Sizing:
    """The Sizing of a pool of `spec` within `lim`; PlanError naming the field of a bad bound."""
    max_batch = positive_int("max_batch_size", lim.max_batch_size)
    max_num_tokens = positive_int("max_num_tokens", lim.max_num_tokens)
    max_num_pages = positive_int("max_num_pages", lim.max_num_pages)
    max_encoder_tokens = positive_int("max_encoder_tokens", max_num_tokens if lim.max_encoder_tokens is None
                                      else lim.max_encoder_tokens)
    buckets = lim.buckets
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise PlanError(f"buckets: expected a sequence of batch sizes, got {buckets!r}")
    # buckets above max_batch_size could never serve a step: dropped
    buckets = tuple(sorted({b for b in (positive_int("buckets", b) for b in buckets) if b <= max_batch}))
    top = max(buckets, default=0)
    per_request = lim.max_pages_per_request
    per_request = min(positive_int("max_pages_per_request", DEFAULT_MAX_PAGES_PER_REQUEST if per_request is None
                                   else per_request), max_num_pages)
    draft_steps = positive_int("max_draft_steps", lim.max_draft_steps)
    if draft_steps > MAX_DRAFT_STEPS:
        raise PlanError(f"max_draft_steps: at most {MAX_DRAFT_STEPS}, got {draft_steps}")
    tree_nodes = positive_int("max_tree_nodes", lim.max_tree_nodes)
    if not MAX_VERIFY_Q_LEN <= tree_nodes <= MAX_TREE_NODES:
        raise PlanError(f"max_tree_nodes: {MAX_VERIFY_Q_LEN}..{MAX_TREE_NODES} (the largest bucketed token tree), "
                        f"got {tree_nodes}")
    if tree_nodes > MAX_VERIFY_Q_LEN:  # (room no step could use: refused)
        if spec.backend != AUTO and not BACKENDS[spec.backend].tree:
            raise PlanError(f"max_tree_nodes: {tree_nodes}, but backend {spec.backend!r} does not verify token trees")
        try:
            check_tree_spec(spec)
        except PlanError as e:
            raise PlanError(f"max_tree_nodes: {tree_nodes}, but this spec does not verify token trees ({e})") from None
    verify_buckets = all(g.causal for g in spec.groups)  # verify steps can be padded (causal kernels)
    max_q = tree_nodes if verify_buckets else 1  # (a chain's verify step: at most MAX_VERIFY_Q_LEN, see Mode)
    # room for padding requests' scratch entries, and for a whole scratch plan or round (capture: one
    # cached token and q_len new ones per request, or a round's tokens) besides max_num_pages real pages
    room = -(-max(max_q + 1, draft_steps) // spec.page_size) + bool(spec.cascade_groups)  # (cascade: a shared page more)
    layout = Layout(max_batch, max(max_num_tokens, top * max_q), max_num_pages + top * room, len(spec.groups),
                    tuple(max_encoder_tokens if g.cross else -int(g.own_pages) for g in spec.groups), draft_steps)
    return Sizing(max_batch_size=max_batch, max_num_tokens=max_num_tokens, max_num_pages=max_num_pages,
                  max_encoder_tokens=max_encoder_tokens, max_pages_per_request=per_request, max_draft_steps=draft_steps,
                  buckets=buckets, bucket_at=tuple(bucket_of(b, buckets) for b in range(top + 1)),
                  max_verify_q_len=max_q, layout=layout)
