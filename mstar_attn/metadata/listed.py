"""build_plan's per-step path for a StepBatch decode step that lists exactly its pages (`plan_listed_decode`), and
the checks of a batch's own page lists (`group_lists`) that it shares with the general path. Pure numpy (and the
compiled builder, native.py, with its Python twin here), host only."""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from mstar_attn.metadata import native
from mstar_attn.metadata._arrays import INT32_MAX, SHORT, read_only
from mstar_attn.metadata.batch import CrossRows, GroupPages, StepBatch
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.groups import GroupPlan, StepArrays, cross_plan, cross_rows_plan, own_plan
from mstar_attn.metadata.pages import LISTED_SHORT, scan_ownership
from mstar_attn.metadata.record import ARANGE, AttentionPlan, Mode, decode_arrays, groups_of, listed_slots, written_pages
from mstar_attn.metadata.select import resolve_backend
from mstar_attn.metadata.spec import AttentionSpec

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # (min / max of a per-step array without ndarray's wrappers)


def plan_listed_decode(batch: StepBatch, spec: AttentionSpec, check_ownership: bool) -> AttentionPlan | None:
    """_plan for a decode step (every q_len 1) whose requests list exactly the pages their lengths need on the
    shared list (the lists of groups that keep their own, cross groups' included, as _plan checks them; no block
    table, cascade off): the same checks and the same plan in fewer numpy calls (the per-step path of an engine that lists pages).
    The batch's arrays: q_lens, kv_lens [B], page_indptr [B+1], page_indices [n] int32 host, read-only; the plan
    shares them (kv_indices: page_indices[:page_indptr[B]]).
    None for any other step, and for one that fails a check of the batch: _plan then names what is wrong, so both
    paths raise the same errors (the backend's check, resolve_backend, raises its own PlanError here, as in _plan)."""
    q, kv, indptr, idx = batch.q_lens, batch.kv_lens, batch.page_indptr, batch.page_indices
    ps, B = spec.page_size, kv.shape[0]
    if batch.block_table is not None or spec.cascade_groups or batch.page_size != ps \
            or q.shape[0] != B or indptr.shape[0] != B + 1 or not 0 < B < ARANGE.shape[0]:
        return None
    shared = not (batch.group_pages or spec.own_page_groups or spec.has_cross)  # every group reads the shared list
    cross = None if shared else _lazy_cross(batch, spec)  # (or all but one cross group of cross-table rows)
    hi = exact_lists(batch, spec, check_ownership)  # (the shared list's checks, whatever the groups)
    if not hi:
        return None
    listed = idx[: indptr[B]]
    if shared or cross is not None:  # a lazy plan of the batch's own arrays (the rest derived on read, or on the device)
        plan = AttentionPlan.lists_decode(spec, q, kv, indptr, listed, hi, resolve_backend(spec, Mode.DECODE, B, B, 1, hi),
                                          cross)
        object.__setattr__(plan, "sealed", True)
        return plan
    step = decode_arrays(spec, q, kv, hi)  # (its kv_indptr: the batch's indptr, checked)
    written, slot_mapping = decode_slots(listed, indptr, step.last_page_len, ps)
    read_only(listed, slot_mapping)
    step.kv_indptr, step.kv_indices, step.slot_mapping = indptr, listed, slot_mapping  # (the batch's own, as in _plan)
    own = None
    if batch.group_pages or spec.own_page_groups:  # (the groups' own lists: _plan's checks, on these arrays)
        try:
            own = group_lists(batch, spec, step, spec.num_pages, check_ownership)
        except PlanError:
            return None
    plan = AttentionPlan.listed_decode(spec, step, groups_of(spec, step, own), resolve_backend(spec, Mode.DECODE, B, B, 1, hi))
    object.__setattr__(plan, "sealed", True)
    return plan


def exact_lists(batch: StepBatch, spec: AttentionSpec, check_ownership: bool) -> int:
    """The checks of a decode step listing exactly its pages on the shared list (after plan_listed_decode's shape
    checks): the longest kv_len when they pass, else 0. The compiled builder's answer (native.exact_lists) for a
    from_csr batch where it is in use, else the Python twin's (twin_exact_lists): the same."""
    packed = batch.packed
    if packed is not None:
        hi = native.exact_lists(packed, batch.kv_lens.shape[0], batch.page_indices.shape[0], spec.page_size,
                                spec.num_pages, check_ownership)
        if hi is not None:
            return hi
    return twin_exact_lists(batch, spec, check_ownership)


def twin_exact_lists(batch: StepBatch, spec: AttentionSpec, check_ownership: bool) -> int:
    """exact_lists in Python (the twin of step_checks.c's): every q_len 1 and kv_len >= 1 (the longest within int32
    with every page count sum), page_indptr the running sum of the pages each length needs from 0, within
    page_indices, every listed page id in 0..num_pages - 1, and (check_ownership) each written page (a request's
    last) listed once in all, by its writer. The longest kv_len, or 0. Python ints where the step is short."""
    kv, indptr, idx, ps = batch.kv_lens, batch.page_indptr, batch.page_indices, spec.page_size
    checked = _lengths(batch.q_lens, kv, ps)
    if checked is None:
        return 0
    lengths, hi = checked
    B = kv.shape[0]
    if lengths is not None:  # each list exactly its pages: indptr is the running sum of the pages each length needs
        ends = list(accumulate([(k + ps - 1) // ps for k in lengths]))
        if indptr.tolist() != [0, *ends]:
            return 0
        end = ends[-1]
    else:
        need = kv + (ps - 1)
        need //= ps
        ends = np.cumsum(need, dtype=np.int32)  # (int32: every sum of need fits, checked by _lengths)
        if indptr[0] != 0 or ends.tobytes() != indptr[1:].tobytes():
            return 0
        end = int(ends[-1])
    if end > idx.shape[0]:
        return 0
    listed = idx[:end]
    if end <= LISTED_SHORT:  # (Python's min, max and a set over a short list: cheaper than numpy's fixed cost)
        pages = listed.tolist()
        if min(pages) < 0 or max(pages) >= spec.num_pages:
            return 0
        if check_ownership:  # each written page (a request's last) listed once in all, by its writer
            writers = set(pages[e - 1] for e in (ends if lengths is not None else ends.tolist()))
            if len(writers) != B or sum(map(writers.__contains__, pages)) != B:
                return 0
    else:
        if _MIN(listed) < 0 or _MAX(listed) >= spec.num_pages:
            return 0
        if check_ownership:
            try:
                scan_ownership(spec, indptr, listed, written_pages(listed, indptr))
            except PlanError:
                return 0
    return hi


def _lengths(q: np.ndarray, kv: np.ndarray, ps: int) -> tuple[list[int] | None, int] | None:
    """(the kv_lens as Python ints for at most SHORT requests, else None; the longest) of a decode step: every q_len
    1, every kv_len >= 1, the longest within int32 with every sum of page counts (B * (longest / ps + 1)); else None."""
    B = kv.shape[0]
    if B <= SHORT:  # (Python's min / max over a short list: cheaper than numpy's reductions' fixed cost)
        new, lengths = q.tolist(), kv.tolist()
        one, lo, hi = min(new) == max(new) == 1, min(lengths), max(lengths)
    else:
        lengths, (one, lo, hi) = None, (_MIN(q) == _MAX(q) == 1, int(_MIN(kv)), int(_MAX(kv)))
    if not one or lo < 1 or hi > INT32_MAX - ps or B * (hi // ps + 1) > INT32_MAX:  # (every sum of need fits int32:
        return None                                                                    # an indptr matching it never wrapped)
    return lengths, hi


def _lazy_cross(batch: StepBatch, spec: AttentionSpec) -> GroupPlan | None:
    """The cross group's GroupPlan of a step whose only own list is its spec's only own-list group, a cross group
    other than group 0, given as cross-table rows (CrossRows) storing nothing (a lazy plan's: the pool derives its
    pages on the device); None for any other step, and where cross_rows_plan refuses (_plan then names it)."""
    own = spec.own_page_groups
    if len(own) != 1 or own[0] == 0 or len(batch.group_pages) != 1 or not spec.groups[own[0]].cross:
        return None
    g, pages = batch.group_pages[0]
    if g != own[0] or not isinstance(pages, CrossRows):
        return None
    try:
        gp = cross_rows_plan(g, pages, spec, batch.kv_lens.shape[0])
    except PlanError:
        return None
    return None if gp.stored else gp


def group_lists(batch: StepBatch, spec: AttentionSpec, step: StepArrays, page_limit: int, check_ownership: bool) -> dict:
    """The GroupPlans of the groups with lists of their own (cross-table rows, cross pages, own pages), checked."""
    B = step.q.shape[0]
    return {g: cross_rows_plan(g, pages, spec, B) if isinstance(pages, CrossRows)
            else cross_plan(g, pages, spec, B, page_limit, check_ownership) if spec.groups[g].cross
            else own_plan(g, pages, spec, step, page_limit, check_ownership)
            for g, pages in _own_lists(batch, spec)}


def decode_slots(kv_indices: np.ndarray, kv_indptr: np.ndarray, last_page_len: np.ndarray, ps: int):
    """A decode step's written pages [B] (record.written_pages) and slot_mapping [B] int64 (record.listed_slots)."""
    written = written_pages(kv_indices, kv_indptr)
    return written, listed_slots(written, last_page_len, ps)


def _own_lists(batch: StepBatch, spec: AttentionSpec) -> list[tuple[int, GroupPages]]:
    """The batch's own page lists, checked against the spec: exactly the own_pages groups have one."""
    for g, _ in batch.group_pages:
        if g >= len(spec.groups):
            raise PlanError(f"group_pages[{g}]: the spec has {len(spec.groups)} layer groups (0..{len(spec.groups) - 1})")
        if not spec.groups[g].own_pages:
            raise PlanError(f"group_pages[{g}]: layer group {g} reads the shared page list (its LayerGroup has "
                            "own_pages=False), so the batch may not give it a list of its own")
    for g, pages in batch.group_pages:
        if isinstance(pages, CrossRows) and not spec.groups[g].cross:
            raise PlanError(f"group_pages[{g}]: CrossRows name a cross-attention group's encoder pages; layer group {g} "
                            "is not one (give it a GroupPages)")
        if isinstance(pages, CrossRows):
            continue
        if not spec.groups[g].cross and (pages.kv_lens is not None or pages.new_lens is not None):
            raise PlanError(f"group_pages[{g}]: kv_lens / new_lens are for cross-attention groups; layer group {g} "
                            "reads the step's own tokens")
    if sum(isinstance(p, CrossRows) for _, p in batch.group_pages) > 1:
        raise PlanError("group_pages: one cross-attention group per step may name cross-table rows (CrossRows); "
                        "make the cross layers one layer group, or list the other groups' pages (GroupPages.cross)")
    given = {g for g, _ in batch.group_pages}
    for g in spec.own_page_groups:
        if g not in given:
            raise PlanError(f"group_pages: layer group {g} keeps its own page list (own_pages=True); the batch must "
                            f"give it: StepBatch.from_...(..., group_pages={{{g}: GroupPages(...)}})")
    return list(batch.group_pages)
