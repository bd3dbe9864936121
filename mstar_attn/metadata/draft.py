"""Speculative draft rounds: `build_round`, K decode plans from one batch, planned once. Pure numpy.

A draft model proposes K tokens in K short decode steps before the target verifies them. Step j
(0-based) of a round feeds token j of the round (at position kv_lens[i] - 1 + j), writes its K/V
and reads kv_lens[i] + j tokens. The engine gives the round's first step as a decode StepBatch
whose page lists already cover all K tokens (kv_lens + K - 1). The batch is checked once (the
lengths, the page ids, and that each request owns every page the round writes), and the K plans
share its page arrays: every step lists the same pages (the same numpy objects), and only the
O(B) arrays differ (lengths, last_page_len, positions, slot_mapping).

A step therefore lists pages ahead of its length: kv_last_page_len[i] = kv_lens[i] - (pages - 1) *
page_size may be <= 0 (the pages of later tokens of the round). Every backend reads a request's
length, never its page count: FlashInfer takes (pages - 1) * page_size + last_page_len, FA4
seqused_k, the reference kv_lens. Such plans carry `draft_step` and are committed together with
GraphBufferPool.commit_round, never alone.

After the target keeps n of the K tokens, the next plan simply uses the shorter kv_len: the K/V
past it is never read, and the next round writes over it.
"""

from __future__ import annotations

import attrs
import numpy as np

from mstar_attn.metadata._arrays import INT32_MAX, fail_at, positive_int, read_only
from mstar_attn.metadata.batch import StepBatch
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.groups import GroupPlan, first_read_page
from mstar_attn.metadata.pages import gather_ranges, scan_ownership
from mstar_attn.metadata.plan import AttentionPlan, Mode, check_batch, check_lengths, read_pages, resolve_backend
from mstar_attn.metadata.spec import AttentionSpec, Kind

__all__ = ["MAX_DRAFT_STEPS", "DraftRound", "build_round", "scratch_round"]

MAX_DRAFT_STEPS = 16  # the most steps one round may have


@attrs.frozen
class DraftRound:
    """K decode plans over one batch of B requests: steps[j] reads kv_lens + j tokens and writes token j.

    Every step shares the batch's page arrays (kv_indptr [B+1], kv_indices [n] int32 host, each
    window group's trimmed list: one read-only object each for the whole round) and has its own
    O(B) arrays (kv_lens, kv_last_page_len [B] int32; positions, slot_mapping [B] int64: rows of
    [K, B] arrays). Made by build_round (or scratch_round); `sealed` marks that."""

    steps: tuple[AttentionPlan, ...]
    sealed: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    @property
    def k(self) -> int:
        return len(self.steps)

    @property
    def batch_size(self) -> int:
        return self.steps[0].batch_size

    @property
    def backend(self) -> str:
        return self.steps[0].backend


def build_round(batch: StepBatch, spec: AttentionSpec, k: int, *, check_ownership: bool = True) -> DraftRound:
    """The K = k decode plans of a draft round whose first step is `batch`. Pure; raises PlanError.

    batch: a decode step (q_len 1 for every request; kv_lens the lengths after step 0) whose page
    lists cover kv_lens + k - 1 tokens. Checked once, as build_plan checks a step: lengths, page
    counts, page ids, and (check_ownership) that every page the round writes is listed by its
    writer only. Layer groups with their own page lists and cross-attention groups are refused.
    """
    if not isinstance(spec, AttentionSpec):
        raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
    if not isinstance(batch, StepBatch):
        raise PlanError(f"batch: a draft round takes a StepBatch (its page lists), got {type(batch).__name__}")
    k = positive_int("k", k)
    if k > MAX_DRAFT_STEPS:
        raise PlanError(f"k: a draft round has at most {MAX_DRAFT_STEPS} steps, got {k}")
    if not isinstance(check_ownership, bool):
        raise PlanError(f"check_ownership: expected True or False, got {check_ownership!r}")
    _shared_list_spec(spec)
    if batch.group_pages:
        raise PlanError("batch.group_pages: a draft round's groups share one page list; give none")
    if batch.block_table is not None:  # its page lists were cut at kv_lens: take the round's from the table
        batch = _from_table(batch, k)
    return _round(batch, spec, k, check_ownership, spec.num_pages)


def _shared_list_spec(spec: AttentionSpec) -> None:
    if spec.own_page_groups:
        raise PlanError(f"spec: layer group {spec.own_page_groups[0]} keeps its own page list (own_pages) or is cross "
                        "attention; draft rounds serve specs whose groups share one page list")


def _from_table(batch: StepBatch, k: int) -> StepBatch:
    """The batch with each request's page list cut from its block table row for kv_lens + k - 1 tokens."""
    table, ps = batch.block_table, batch.page_size
    need = (batch.kv_lens.astype(np.int64) + (k - 1) + (ps - 1)) // ps
    if need.max() > table.shape[1]:
        fail_at("block_table", need > table.shape[1], f"the row has {table.shape[1]} pages, fewer than the round's {k} "
                                                     "tokens need (kv_len + k - 1 tokens)")
    indptr = np.zeros(need.shape[0] + 1, np.int32)
    np.cumsum(need, out=indptr[1:])
    return StepBatch(batch.q_lens, batch.kv_lens, indptr, table[np.arange(table.shape[1]) < need[:, None]], ps, table)


def scratch_round(spec: AttentionSpec, batch_size: int, k: int, backend: str | None = None) -> DraftRound:
    """A round of `batch_size` requests that read and write only the scratch page (graph capture)."""
    batch_size, k = positive_int("batch_size", batch_size), positive_int("k", k)
    if k > MAX_DRAFT_STEPS:
        raise PlanError(f"k: a draft round has at most {MAX_DRAFT_STEPS} steps, got {k}")
    _shared_list_spec(spec)
    per = -(-k // spec.page_size)
    indptr = np.arange(batch_size + 1, dtype=np.int32) * per
    pages = np.full(batch_size * per, spec.scratch_page, np.int32)
    batch = StepBatch.from_csr(np.ones(batch_size, np.int32), np.ones(batch_size, np.int32), indptr, pages,
                               spec.page_size)
    return _round(batch, spec, k, False, spec.num_pages + 1, backend)


def _round(batch: StepBatch, spec: AttentionSpec, k: int, check_ownership: bool, page_limit: int,
           backend: str | None = None) -> DraftRound:
    ps = spec.page_size
    q, kv0, _ = check_batch(batch, spec)
    B = q.shape[0]
    check_lengths(q, kv0, ps)
    if q.max() != 1:
        fail_at("q_lens", q != 1, "the steps of a draft round add one token per request (q_len 1)")
    top = int(kv0.max()) + k - 1  # the longest length after the round's last step
    if top > INT32_MAX - ps:
        fail_at("kv_lens", kv0 > INT32_MAX - ps - (k - 1), f"kv_len + {k - 1} is past the int32 range the kernels index")
    need = (kv0 + np.int32(k - 1) + (ps - 1)) // ps  # the pages of the round's last token
    kv_indptr, kv_indices, listed = read_pages(spec, batch, need, page_limit, f"fewer than the round's {k} tokens need",
                                               ahead=k - 1)
    if check_ownership:  # the pages of the round's k tokens: the last one, and (when they start a page earlier) the one before
        last_page = kv_indptr[1:] - 1
        first_page = kv_indptr[:-1] + (kv0 - 1) // ps
        if (last_page - first_page).max() <= 1:
            two = first_page != last_page
            written = np.concatenate([kv_indices[last_page], kv_indices[first_page[two]]])
        else:
            written = gather_ranges(kv_indices, first_page, last_page - first_page + 1)[1]
        scan_ownership(spec, batch.page_indptr, listed, written)

    # [K, B] arrays, rows shared by the steps (read-only, so every row view is too)
    kv = kv0 + np.arange(k, dtype=np.int32)[:, None]
    lpl = kv - (need - 1) * ps  # <= 0 where the step has not reached its last listed page
    positions = (kv - 1).astype(np.int64)
    slots = kv_indices[kv_indptr[:-1] + positions // ps].astype(np.int64) * ps + positions % ps
    qo_indptr = np.arange(B + 1, dtype=np.int32)
    read_only(kv, lpl, positions, slots, qo_indptr)
    windows = {}  # one trimmed list per window size, shared by every step (trimmed for step 0, the earliest reader)
    for group in spec.groups:
        if group.kind is Kind.WINDOW and group.window not in windows:
            start = first_read_page(group, q, kv0, ps)
            w_indptr, w_indices = gather_ranges(kv_indices, kv_indptr[:-1] + start, need - start)
            w_start = (start * ps).astype(np.int32)
            w_lens = kv - w_start
            read_only(w_start, w_lens)
            windows[group.window] = (w_indptr, w_indices, w_start, w_lens)
    backend = resolve_backend(spec, Mode.DECODE, B, B, 1, top, backend)
    plans, block_table, low = [], batch.block_table, top - (k - 1)
    for j in range(k):
        groups = tuple(GroupPlan(g, kv_indptr, kv_indices, lpl[j], kv[j]) if g.kind is not Kind.WINDOW
                       else GroupPlan(g, windows[g.window][0], windows[g.window][1], lpl[j], windows[g.window][3][j],
                                      windows[g.window][2])
                       for g in spec.groups)
        plan = AttentionPlan(spec=spec, mode=Mode.DECODE, batch_size=B, num_tokens=B, max_q_len=1, max_kv_len=low + j,
                             q_lens=q, kv_lens=kv[j], qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                             kv_last_page_len=lpl[j], positions=positions[j], slot_mapping=slots[j], groups=groups,
                             block_table=block_table, backend=backend, draft_step=j)
        object.__setattr__(plan, "sealed", True)
        plans.append(plan)
    out = DraftRound(tuple(plans))
    object.__setattr__(out, "sealed", True)
    return out
