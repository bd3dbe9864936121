"""One layer group's part of a plan: `GroupPlan`, and how it is derived for a window group (whole
pages trimmed from the front of the shared list) or a group with its own page list. Pure numpy."""

from __future__ import annotations

import attrs
import numpy as np

from mstar_attn.metadata._arrays import INT32_MAX, SHORT, Ranges, short_page_spans, array_field, fail_at, nullable_array_field, optional_array_field, read_only
from mstar_attn.metadata.batch import CrossRows, GroupPages
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.pages import check_indptr, check_page_ids, gather_ranges, scan_ownership
from mstar_attn.metadata.spec import AttentionSpec, Kind, LayerGroup


@attrs.frozen
class GroupPlan:
    """The page range one layer group's kernel reads, all int32 host arrays over B requests.

    kv_indptr [B+1], kv_indices [n], kv_last_page_len [B], kv_lens [B]: as FlashInfer reads them
    (kv_indices is None in a StepRows plan: the pool gathers the pages on the device).
    kv_start [B] or None: position of the first key covered, when a sliding window trimmed whole
    pages from the front (a multiple of page_size); None means 0 for every request. For full
    and non-causal groups reading the shared list the arrays are the plan's own.
    slot_mapping [T] int64 or None: where the group's layers write each new token, for a group
    with its own page list (LayerGroup.own_pages); None: the plan's slot_mapping. A cross-attention
    group's kv_lens are its encoder lengths and its slot_mapping [sum(new_lens)] places the encoder
    tokens stored this step (see cross_plan); new_lens [B]: the encoder tokens each request stores
    this step (0 or its encoder length); table_rows [B]: rows of the pool's cross table when the
    step gave CrossRows (then kv_indices and slot_mapping are None: commit derives them).
    """

    group: LayerGroup
    kv_indptr: np.ndarray = array_field()
    kv_indices: np.ndarray | None = nullable_array_field()
    kv_last_page_len: np.ndarray = array_field()
    kv_lens: np.ndarray = array_field()
    kv_start: np.ndarray | None = optional_array_field()
    slot_mapping: np.ndarray | None = optional_array_field()
    new_lens: np.ndarray | None = optional_array_field()
    table_rows: np.ndarray | None = optional_array_field()
    # encoder tokens a cross group stores this step (write_kv's rows for it; sum(new_lens)); 0 for other groups
    stored: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "stored", 0 if self.new_lens is None else int(self.new_lens.sum(dtype=np.int64)))


@attrs.define(kw_only=True, slots=True)
class StepArrays:
    """The arrays a plan derives from a step's lengths, B requests and T new tokens (host numpy; see
    AttentionPlan for each): q [B], kv [B], qo_indptr [B+1], positions [T], need [B] (the pages each
    request reads), kv_indptr [B+1], last_page_len [B], and the shared list's kv_indices and
    slot_mapping when the step lists pages; mode is a plan.Mode; max_kv: kv.max() when known."""

    mode: object  # plan.Mode (defined above this module)
    q: np.ndarray
    kv: np.ndarray
    num_tokens: int
    q_max: int
    qo_indptr: np.ndarray
    positions: np.ndarray
    need: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    kv_indices: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    max_kv: int | None = None


def first_read_page(group: LayerGroup, q: np.ndarray, kv: np.ndarray, ps: int) -> np.ndarray:
    """[B] the first logical page any query of the step can see: a window group sees the last
    window + q - 1 keys; every other group sees from position 0."""
    if group.kind is not Kind.WINDOW:
        return np.zeros_like(kv)
    return np.maximum(kv - q - (group.window - 1), 0) // ps


def window_decode_ranges(group: LayerGroup, kv: np.ndarray, ranges: Ranges, ps: int) -> Ranges:
    """For a decode step (q_len 1) with kv_lens kv ([B] int32, each request's window-group length in `ranges`, a
    Ranges over the group's own lengths kv - first_read_page * ps), the plan kv_lens [B] whose group lengths stay
    in `ranges`: within the step's first read page (a monotone stretch: the group length is kv itself up to
    window + ps - 1, then kv - m * ps over the m-th page past the window), or every length from max(low, 1) on for
    a request whose range holds every length past the window (window .. window + ps - 1). Host only, numpy."""
    W = group.window
    m = first_read_page(group, 1, kv.astype(np.int64), ps)
    low, high = ranges.low.astype(np.int64), ranges.low.astype(np.int64) + ranges.span.astype(np.int64)
    lo = np.maximum(np.where(m == 0, 1, W + m * ps), low + m * ps)
    hi = np.minimum(W + (m + 1) * ps, high + m * ps)  # (exclusive)
    wide = (low <= W) & (high >= W + ps)  # (past the window every length lies in the range: up to int32's)
    lo, hi = np.where(wide, np.maximum(low, 1), lo), np.where(wide, 2**31, hi)
    return Ranges(lo.astype(np.int32), np.maximum(hi - lo, 0).astype(np.uint32))


def window_plan(group: LayerGroup, kv_indptr, kv_indices, last_page_len, q, kv, need, ps: int) -> GroupPlan:
    """Trim whole pages of the shared list that no query of the step can see: keep the last window
    + q - 1 keys. Without page ids (a StepRows plan) only the ranges are derived: the device gathers the pages."""
    start_page = first_read_page(group, q, kv, ps)
    if kv_indices is None:
        indptr, indices = np.zeros_like(kv_indptr), None
        np.cumsum(need - start_page, out=indptr[1:])
    else:
        indptr, indices = gather_ranges(kv_indices, kv_indptr[:-1] + start_page, need - start_page)
    kv_start = (start_page * ps).astype(np.int32)
    kv_lens = (kv - kv_start).astype(np.int32)
    read_only(indptr, kv_start, kv_lens)
    return GroupPlan(group, indptr, indices, last_page_len, kv_lens, kv_start)


def own_plan(g: int, pages: GroupPages, spec: AttentionSpec, step: StepArrays, page_limit: int,
             check_ownership: bool) -> GroupPlan:
    """Layer group g's plan from its own list: checked (shapes, reach, page ids, ownership within the
    group's id space), trimmed to the pages the step reads, with the group's own slot_mapping.

    step: the plan's arrays (q, kv, need, last_page_len, positions); page ids below page_limit are
    valid (num_pages, or num_pages + 1 for scratch plans)."""
    q, kv, need, last_page_len, positions = step.q, step.kv, step.need, step.last_page_len, step.positions
    decode = step.q_max == 1  # one token per request
    group, ps, B, name = spec.groups[g], spec.page_size, q.shape[0], f"group_pages[{g}]"
    first, indptr, idx = pages.first_page, pages.page_indptr, pages.page_indices
    if first.shape != (B,) or indptr.shape != (B + 1,):
        raise PlanError(f"{name}: first_page {first.shape} and page_indptr {indptr.shape} must be [B] and [B+1] (B = {B})")
    check_indptr(f"{name}.page_indptr", indptr, idx.shape[0])
    start = first_read_page(group, q, kv, ps)
    bad = (first < 0) | (first > start)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"{name}.first_page[{i}]: the list starts at logical page {first[i]}, but the step reads from "
                        f"page {start[i]} on (kv_len {kv[i]}, q_len {q[i]}, "
                        + (f"window {group.window}" if group.window else "a full group reads from page 0")
                        + f"; page = position // {ps}) (request {i})")
    counts = indptr[1:] - indptr[:-1]
    short = first.astype(np.int64) + counts < need
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise PlanError(f"{name}.page_indices[{i}]: lists {indptr[i + 1] - indptr[i]} pages from logical page {first[i]}, "
                        f"fewer than kv_len {kv[i]} needs (up to page {need[i] - 1}) (request {i})")
    listed = idx[: indptr[-1]]
    check_page_ids(spec, f"{name}.page_indices", indptr, listed, page_limit)
    if np.array_equal(counts, need - start):  # (so first == start, by the checks above: each list is what the step reads)
        kv_indptr, kv_indices = indptr, listed
    else:
        kv_indptr, kv_indices = gather_ranges(idx, indptr[:-1] + (start - first), need - start)
    if decode:  # one token per request, on its last page
        written = kv_indices[kv_indptr[1:] - 1]
        slots = np.multiply(written, ps, dtype=np.int64)
        slots += last_page_len - 1
    else:
        page_of = np.repeat(kv_indptr[:-1] - start, q) + positions // ps
        slots = kv_indices[page_of].astype(np.int64) * ps + positions % ps
        first_written = (kv - q) // ps
        written = gather_ranges(kv_indices, kv_indptr[:-1] + (first_written - start), need - first_written)[1]
    if check_ownership:
        scan_ownership(spec, indptr, listed, written, f"{name}.page_indices")
    kv_start = (start * ps).astype(np.int32) if group.kind is Kind.WINDOW else None
    kv_lens = kv if kv_start is None else (kv - kv_start).astype(np.int32)
    read_only(slots, kv_lens, *(() if kv_start is None else (kv_start,)))
    return GroupPlan(group, kv_indptr, kv_indices, last_page_len, kv_lens, kv_start, slots)


def _cross_lengths(name: str, kv, new, ps: int) -> None:
    if kv.min() < 1:
        fail_at(f"{name}.kv_lens", kv < 1, "a step with cross-attention layers needs encoder input for every request "
                                            "(encoder length >= 1)")
    if kv.max() > INT32_MAX - ps:
        fail_at(f"{name}.kv_lens", kv > INT32_MAX - ps, "the encoder length is past the int32 range the kernels index")
    if ((new != 0) & (new != kv)).any():
        fail_at(f"{name}.new_lens", (new != 0) & (new != kv), "a step stores a request's whole encoder K/V or none (0)")
    if new.sum(dtype=np.int64) > INT32_MAX:
        raise PlanError(f"{name}.new_lens: more encoder tokens in one step than int32 row offsets hold")


def cross_rows_plan(g: int, lists: CrossRows, spec: AttentionSpec, B: int) -> GroupPlan:
    """Cross-attention group g's plan over rows of the pool's cross table: lengths and ranges only
    (O(B)); commit checks the rows and gathers their pages on the device."""
    group, ps, name = spec.groups[g], spec.page_size, f"group_pages[{g}]"
    rows, kv, new = lists.rows, lists.kv_lens, lists.new_lens
    if rows.shape != (B,) or kv.shape != (B,) or new.shape != (B,):
        raise PlanError(f"{name}: rows {rows.shape}, kv_lens {kv.shape} and new_lens {new.shape} must be [B] (B = {B})")
    if 0 < B <= SHORT and (plan := _short_cross_rows(group, lists, ps)) is not None:
        return plan
    _cross_lengths(name, kv, new, ps)
    if rows.min() < 0:
        fail_at(f"{name}.rows", rows < 0, "a cross-table row is negative")
    need = (kv + (ps - 1)) // ps
    if B * (int(kv.max()) // ps + 1) > INT32_MAX:
        raise PlanError(f"{name}.kv_lens: more encoder pages in one step than int32 page offsets hold")
    kv_indptr = np.zeros(B + 1, np.int32)
    np.cumsum(need, out=kv_indptr[1:])
    last_page_len = (kv - (need - 1) * ps).astype(np.int32)
    read_only(kv_indptr, last_page_len)
    return GroupPlan(group, kv_indptr, None, last_page_len, kv, None, None, new, rows)


def _short_cross_rows(group: LayerGroup, lists: CrossRows, ps: int) -> GroupPlan | None:
    """cross_rows_plan for 1..SHORT requests, on Python ints (numpy's fixed cost per call is higher): the same plan
    (kv_indptr [B+1] and kv_last_page_len [B] int32, read-only views of one array; lists' own [B] int32 kv_lens,
    new_lens and rows), or None when a check fails (cross_rows_plan's numpy checks then name it)."""
    lengths, new, rows = lists.kv_lens.tolist(), lists.new_lens.tolist(), lists.rows.tolist()
    if not (min(lengths) >= 1 and max(lengths) <= INT32_MAX - ps and min(rows) >= 0 and sum(new) <= INT32_MAX
            and all(n == 0 or n == k for n, k in zip(new, lengths))
            and len(lengths) * (max(lengths) // ps + 1) <= INT32_MAX):
        return None
    kv_indptr, last_page_len, _ = short_page_spans(lengths, ps)
    return GroupPlan(group, kv_indptr, None, last_page_len, lists.kv_lens, None, None, lists.new_lens, lists.rows)


def cross_plan(g: int, pages: GroupPages, spec: AttentionSpec, B: int, page_limit: int,
               check_ownership: bool) -> GroupPlan:
    """Cross-attention group g's plan: every decoder query of request i sees all kv_lens[i] encoder
    keys on the group's own pages. Its slot_mapping [sum(new_lens)] int64 places the encoder tokens
    stored this step, request by request (empty on steps that store none)."""
    group, ps, name = spec.groups[g], spec.page_size, f"group_pages[{g}]"
    kv, new, first, indptr, idx = pages.kv_lens, pages.new_lens, pages.first_page, pages.page_indptr, pages.page_indices
    if kv is None:
        raise PlanError(f"{name}.kv_lens: layer group {g} is cross attention; give each request's encoder length "
                        "(GroupPages.cross(pages, encoder_lens, write))")
    new = np.zeros_like(kv) if new is None else new
    if first.shape != (B,) or kv.shape != (B,) or new.shape != (B,) or indptr.shape != (B + 1,):
        raise PlanError(f"{name}: first_page {first.shape}, kv_lens {kv.shape}, new_lens {new.shape} and page_indptr "
                        f"{indptr.shape} must be [B], [B], [B] and [B+1] (B = {B})")
    _cross_lengths(name, kv, new, ps)
    if first.any():
        fail_at(f"{name}.first_page", first != 0, "a cross-attention list starts at the encoder's first page (0)")
    check_indptr(f"{name}.page_indptr", indptr, idx.shape[0])
    need = (kv + (ps - 1)) // ps
    short = indptr[1:] - indptr[:-1] < need
    if short.any():
        fail_at(f"{name}.page_indices", short, "fewer pages than the encoder length needs")
    listed = idx[: indptr[-1]]
    check_page_ids(spec, f"{name}.page_indices", indptr, listed, page_limit)
    kv_indptr, kv_indices = gather_ranges(idx, indptr[:-1], need)
    last_page_len = (kv - (need - 1) * ps).astype(np.int32)
    T = int(new.sum(dtype=np.int64))
    starts = np.zeros(B + 1, np.int64)
    np.cumsum(new, out=starts[1:])
    pos = np.arange(T, dtype=np.int64) - np.repeat(starts[:-1], new)  # each stored token's encoder position
    slots = kv_indices[np.repeat(kv_indptr[:-1], new) + pos // ps].astype(np.int64) * ps + pos % ps
    if check_ownership and T:
        w = new > 0
        written = gather_ranges(kv_indices, kv_indptr[:-1][w], need[w])[1]
        scan_ownership(spec, indptr, listed, written, f"{name}.page_indices")
    read_only(last_page_len, slots)
    return GroupPlan(group, kv_indptr, kv_indices, last_page_len, kv, None, slots, new)
