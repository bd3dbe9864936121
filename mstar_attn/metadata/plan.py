"""`build_plan`: a pure function from a StepBatch and an AttentionSpec to a frozen AttentionPlan.

Numpy only, host only: no torch tensors, no GPU, no globals. Every array in a plan is a read-only
host numpy array; plans share arrays with the (immutable) StepBatch they came from.
"""

from __future__ import annotations

import numpy as np

from mstar_attn.metadata._arrays import INT32_MAX, SHORT_CHECK, fail_at, read_only
import attrs

from mstar_attn.metadata.backends import AUTO, AUTO_CASCADE, BACKENDS, CASCADE_BACKENDS, TREE_BACKENDS
from mstar_attn.metadata import native
from mstar_attn.metadata.batch import GroupPages, StepBatch, StepRows
from mstar_attn.metadata.cascade import plan_cascade
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.groups import GroupPlan, StepArrays
from mstar_attn.metadata.listed import decode_slots, group_lists, plan_listed_decode
from mstar_attn.metadata.pages import gather_ranges, read_pages, scan_ownership
from mstar_attn.metadata.select import resolve_backend
from mstar_attn.metadata.record import (ARANGE, MAX_VERIFY_Q_LEN, AttentionPlan, Mode, decode_qo_indptr, groups_of,
                                         new_token_positions)
from mstar_attn.metadata.spec import AttentionSpec, Kind
from mstar_attn.metadata.tree import DraftTree

__all__ = ["MAX_VERIFY_Q_LEN", "AttentionPlan", "GroupPlan", "Mode", "build_plan", "build_tree_plan", "scratch_plan"]

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # (min / max of a per-step array without ndarray's wrappers)


def build_plan(batch: StepBatch | StepRows, spec: AttentionSpec, *, check_ownership: bool = True) -> AttentionPlan:
    """Validate a step and derive every index array the backends read. Pure; raises PlanError.

    A StepBatch lists its pages (CSR or block table). Always checked (O(B) plus one min/max over the
    listed pages): lengths (and that every derived sum fits int32), page counts, every listed page
    id inside 0..num_pages-1 (so never the scratch page), page size, backend support.
    check_ownership adds an O(pages) scan that every page written this step is listed by its writer
    only (see `pages.scan_ownership`); an engine whose allocator guarantees that may turn it off.

    A StepRows names rows of the pool's page table instead: the plan is O(B + new tokens) (no page
    ids: kv_indices and slot_mapping are None), and commit checks the pages against the table,
    which enforces ownership as pages are assigned (check_ownership does not apply).
    """
    if batch.__class__ is StepRows and batch.decode_step and spec.__class__ is AttentionSpec:  # (per decode step)
        return _plan_rows_decode(batch, spec)
    if not isinstance(spec, AttentionSpec):
        raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
    if isinstance(batch, StepRows):
        return _plan_rows(batch, spec)
    if not isinstance(batch, StepBatch):
        raise PlanError(f"batch: expected a StepBatch or StepRows, got {type(batch).__name__}")
    if not isinstance(check_ownership, bool):
        raise PlanError(f"check_ownership: expected True or False, got {check_ownership!r}")
    return plan_listed_decode(batch, spec, check_ownership) or _plan(batch, spec, check_ownership, spec.num_pages)


def build_tree_plan(batch: StepBatch | StepRows, spec: AttentionSpec, tree: DraftTree) -> AttentionPlan:
    """The verify step of draft token trees (metadata/tree.py): `batch` as for build_plan, request i's new
    tokens being tree i's tokens in its order (q_lens == tree.sizes), stored like any step's; each token
    attends to the cached prefix and to its ancestors and itself (plan.tree), and sits at position
    prefix + depth (plan.positions: the RoPE positions; plan.cache_positions: where its K/V are stored, tree
    order). A StepRows batch works too (accepted_moves then takes the slots from the pool's table:
    PageTable.slots_of). Pure; PlanError for a tree that does not match
    the batch, a spec with window, non-causal or cross groups or cascade on, or a backend that does not
    declare token trees (Capabilities.tree)."""
    if not isinstance(tree, DraftTree) or not tree.sealed:
        raise PlanError(f"tree: expected a DraftTree made by DraftTree.from_parents, got {type(tree).__name__}"
                        + (" (hand-made or attrs.evolve'd: not checked)" if isinstance(tree, DraftTree) else ""))
    if not isinstance(spec, AttentionSpec):
        raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
    check_tree_spec(spec)
    return _with_tree(spec, build_plan(batch, spec), tree)


def serves_trees(spec: AttentionSpec) -> bool:
    """Whether token-tree verify steps serve this spec (check_tree_spec passes)."""
    try:
        check_tree_spec(spec)
    except PlanError:
        return False
    return True


def check_tree_spec(spec: AttentionSpec) -> None:
    """PlanError unless every layer group is full causal attention and cascade is off."""
    bad = [g for g, group in enumerate(spec.groups) if group.kind is not Kind.CAUSAL]
    if bad:
        raise PlanError(f"spec.groups[{bad[0]}]: tree verify serves full causal layer groups, not "
                        f"{spec.groups[bad[0]].kind.value}")
    if spec.cascade != "off":
        raise PlanError(f"spec.cascade: tree verify reads every page flat (cascade {spec.cascade!r}: use 'off')")


def _with_tree(spec: AttentionSpec, plan: AttentionPlan, tree: DraftTree) -> AttentionPlan:
    """`plan` as the verify step of `tree` (its sizes the plan's q_lens): positions by depth, sealed."""
    q = plan.q_lens
    if q.shape != tree.sizes.shape:
        raise PlanError(f"tree: {tree.batch_size} trees for a batch of {plan.batch_size} requests")
    if (q != tree.sizes).any():
        fail_at("q_lens", q != tree.sizes, "its new tokens are not its tree's tokens (q_len != tree.sizes)")
    if not BACKENDS[plan.backend].tree:
        asked = repr(plan.backend) if spec.backend == plan.backend else f"{spec.backend!r} (its pick: {plan.backend!r})"
        raise PlanError(f"backend: {asked} does not serve token trees (backends that do: "
                        f"{', '.join(repr(n) for n in TREE_BACKENDS)})")
    positions = np.repeat((plan.kv_lens - q).astype(np.int64), q) + tree.depth
    read_only(positions)
    mode = plan.mode  # (one tree size past MAX_VERIFY_Q_LEN over cached prefixes: still a verify step, see Mode)
    if mode is Mode.EXTEND and q.min() == q.max() and (plan.kv_lens > q).all():
        mode = Mode.VERIFY
    out = attrs.evolve(plan, positions=positions, tree=tree, mode=mode)
    object.__setattr__(out, "sealed", True)
    return out


def scratch_plan(spec: AttentionSpec, batch_size: int, q_len: int = 1, backend: str | None = None,
                 cascade: bool = False, prefill: bool = False, tree: bool = False) -> AttentionPlan:
    """A plan of `batch_size` requests that read and write only the scratch page: a decode step
    (q_len 1, kv_len 1), a verify step (q_len new tokens after one cached token), or with `prefill`
    q_len new tokens and no cached ones. Graph capture and warm-up run on it, so neither touches a
    request's KV. backend: the backend to plan for (default: the spec's, or with "auto" the
    dispatcher's pick). cascade (a spec with cascade on): every request reads one whole cached
    scratch page first, all in one prefix group. tree: a verify step of token trees, each a chain of
    q_len tokens (what graph capture of tree steps records on)."""
    ps = spec.page_size
    if prefill and q_len < 2:
        raise PlanError(f"scratch_plan: a prefill step has 2+ new tokens per request (q_len 1 and no cached ones is a "
                        f"decode step), got q_len {q_len}")
    kv = (q_len if prefill else 1 if q_len == 1 else q_len + 1) + (ps if cascade else 0)
    per = -(-kv // ps)
    q_lens, kv_lens = np.full(batch_size, q_len, np.int32), np.full(batch_size, kv, np.int32)
    indptr = np.arange(batch_size + 1, dtype=np.int32) * per
    pages = np.full(batch_size * per, spec.scratch_page, np.int32)
    own = {g: GroupPages(np.zeros(batch_size, np.int32), indptr, pages,
                         *((kv_lens, None) if spec.groups[g].cross else (None, None)))
           for g in spec.own_page_groups}
    batch = StepBatch.from_csr(q_lens, kv_lens, indptr, pages, ps, own)
    if cascade and not spec.cascade_groups:
        raise PlanError("scratch_plan: cascade=True needs a spec with cascade on (AttentionSpec.cascade)")
    if cascade and (batch_size < 2 or (backend or spec.backend) not in (*CASCADE_BACKENDS, AUTO)):
        raise PlanError(f"scratch_plan: a cascade step has 2+ requests (got {batch_size}) and runs on flashinfer or "
                        f"reference (got {backend or spec.backend!r})")
    plan = _plan(batch, spec, False, spec.num_pages + 1, backend, cascade)
    if not tree:
        return plan
    if prefill or q_len < 2 or cascade:
        raise PlanError(f"scratch_plan: a tree step is a verify step of 2+ tokens per request without cascade (got "
                        f"q_len {q_len}{', prefill' if prefill else ''}{', cascade' if cascade else ''})")
    check_tree_spec(spec)
    return _with_tree(spec, plan, DraftTree.from_parents([list(range(-1, q_len - 1))] * batch_size))


def check_batch(batch: StepBatch, spec: AttentionSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PlanError unless the batch's page size is the spec's and page_indptr is [B+1]; its q_lens,
    kv_lens, page_indptr (int32 host vectors)."""
    if batch.page_size != spec.page_size:
        raise PlanError(f"page_size: the batch says {batch.page_size}, the cache has {spec.page_size}")
    q, kv, indptr = batch.q_lens, batch.kv_lens, batch.page_indptr
    if indptr.shape != (q.shape[0] + 1,):
        raise PlanError(f"shapes: q_lens {q.shape} and page_indptr {indptr.shape} must be [B] and [B+1]")
    return q, kv, indptr


def check_lengths(q: np.ndarray, kv: np.ndarray, ps: int) -> int:
    """PlanError unless every request has q_len >= 1 and q_len <= kv_len < int32 - page_size; returns max q_len."""
    B = q.shape[0]
    if B == 0:
        raise PlanError("q_lens: the batch is empty")
    if kv.shape != (B,):
        raise PlanError(f"shapes: q_lens {q.shape} and kv_lens {kv.shape} must both be [B]")
    q_max = q.max()
    if q.min() < 1:
        fail_at("q_lens", q < 1, "every request needs at least one new token")
    if (kv.min() < 1) if q_max == 1 else (kv < q).any():
        fail_at("kv_lens", kv < q, "kv_len (after the step) is smaller than q_len")
    if kv.max() > INT32_MAX - ps:
        fail_at("kv_lens", kv > INT32_MAX - ps, f"kv_len is past the int32 range the kernels index ({INT32_MAX - ps})")
    return int(q_max)


def _new_tokens(q: np.ndarray, kv: np.ndarray, q_max: int) -> tuple[Mode, int, np.ndarray, np.ndarray]:
    """The step's mode, token count T, qo_indptr [B+1] int32 and positions [T] int64."""
    B = q.shape[0]
    if q_max == 1:  # decode: one token per request, at position kv_len - 1
        return Mode.DECODE, B, decode_qo_indptr(B), np.subtract(kv, 1, dtype=np.int64)
    T = int(q.sum(dtype=np.int64))
    if T > INT32_MAX:
        raise PlanError(f"q_lens: {T} new tokens in all, more than int32 row offsets hold")
    qo_indptr = np.zeros(B + 1, np.int32)
    np.cumsum(q, out=qo_indptr[1:])
    prefix = kv - q
    positions = new_token_positions(q, kv, qo_indptr)
    if not prefix.any():
        mode = Mode.PREFILL
    elif q.min() == q_max <= MAX_VERIFY_Q_LEN and prefix.all():
        mode = Mode.VERIFY
    elif q.min() == 1:
        mode = Mode.MIXED
    else:
        mode = Mode.EXTEND
    return mode, T, qo_indptr, positions


def _plan(batch: StepBatch, spec: AttentionSpec, check_ownership: bool, page_limit: int,
          backend: str | None = None, cascade: bool | None = None) -> AttentionPlan:
    ps = spec.page_size  # the spec checked its backend's support when it was made
    q, kv, indptr = check_batch(batch, spec)
    q_max = check_lengths(q, kv, ps)
    need = (kv + (ps - 1)) // ps
    kv_indptr, kv_indices, listed = read_pages(spec, batch, need, page_limit,
                                               "fewer than its KV length needs")
    last_page_len = kv - need * ps
    last_page_len += ps

    mode, T, qo_indptr, positions = _new_tokens(q, kv, q_max)
    if mode is Mode.DECODE:  # one token per request, written on its last page
        written, slot_mapping = decode_slots(kv_indices, kv_indptr, last_page_len, ps)
    else:
        page_of = np.repeat(kv_indptr[:-1], q) + (positions // ps)
        slot_mapping = kv_indices[page_of].astype(np.int64) * ps + positions % ps
        first_written = (kv - q) // ps
        written = gather_ranges(kv_indices, kv_indptr[:-1] + first_written, need - first_written)[1]
    if check_ownership:
        scan_ownership(spec, indptr, listed, written)
    read_only(kv_indices, slot_mapping)
    step = StepArrays(mode=mode, q=q, kv=kv, num_tokens=T, q_max=q_max, qo_indptr=qo_indptr, positions=positions, need=need,
                      kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=last_page_len, slot_mapping=slot_mapping)
    own = group_lists(batch, spec, step, page_limit, check_ownership)
    return _finish(spec, step, block_table=batch.block_table, backend=backend, own=own, cascade=cascade)


def _plan_rows(batch: StepRows, spec: AttentionSpec) -> AttentionPlan:
    """The plan of a step over the pool's page table: O(B + T), no page ids (see build_plan)."""
    rows, q, kv, ps = batch.rows, batch.q_lens, batch.kv_lens, spec.page_size
    if spec.own_page_groups:
        raise PlanError(f"StepRows: layer group {spec.own_page_groups[0]} keeps its own page list (own_pages), which "
                        "the pool's page table does not hold; describe such steps with a StepBatch")
    if rows.shape != q.shape:
        raise PlanError(f"shapes: rows {rows.shape} and q_lens {q.shape} must both be [B]")
    q_max = check_lengths(q, kv, ps)
    if rows.min() < 0:
        fail_at("rows", rows < 0, "a page-table row is negative")
    need = (kv + (ps - 1)) // ps
    if q.shape[0] * (int(kv.max()) // ps + 1) > INT32_MAX:  # (sums of `need` must fit int32 indptrs)
        raise PlanError(f"kv_lens: {int(need.sum(dtype=np.int64))} pages in all, more than int32 page offsets hold")
    kv_indptr = np.zeros(q.shape[0] + 1, np.int32)
    np.cumsum(need, out=kv_indptr[1:])
    last_page_len = kv - need * ps
    last_page_len += ps
    mode, T, qo_indptr, positions = _new_tokens(q, kv, q_max)
    step = StepArrays(mode=mode, q=q, kv=kv, num_tokens=T, q_max=q_max, qo_indptr=qo_indptr, positions=positions, need=need,
                 kv_indptr=kv_indptr, last_page_len=last_page_len)
    return _finish(spec, step, rows=rows)


def _plan_rows_decode(batch: StepRows, spec: AttentionSpec) -> AttentionPlan:
    """_plan_rows for a StepRows.decode step (q_lens all 1 by construction): the same checks in three
    reductions, and a plan whose arrays are derived on first read (the per-step host path of a decoding
    engine: a pool derives them on the device)."""
    rows, q, kv, ps = batch.rows, batch.q_lens, batch.kv_lens, spec.page_size
    B = kv.shape[0]
    if spec.own_page_groups or rows.shape[0] != B or not 0 < B < ARANGE.shape[0]:
        return _plan_rows(batch, spec)  # (its general checks name what is wrong)
    if B <= SHORT_CHECK:  # (Python's min / max over a short list: cheaper than numpy's reductions' fixed cost)
        lengths, table_rows = kv.tolist(), rows.tolist()
        lo, hi, first_row = min(lengths), max(lengths), min(table_rows)
    elif (packed := batch.packed) is not None and (hi := native.rows_decode(packed, B, ps)):
        lo = first_row = 1  # (the compiled builder's checks passed: the three below)
    else:  # (the ufuncs' own reduce: ndarray.min / max add a Python wrapper per call)
        lo, hi, first_row = int(_MIN(kv)), int(_MAX(kv)), int(_MIN(rows))
    if lo < 1:
        fail_at("kv_lens", kv < 1, "kv_len (after the step) is smaller than q_len")
    if hi > INT32_MAX - ps or B * (hi // ps + 1) > INT32_MAX:
        check_lengths(q, kv, ps)  # (raises past the int32 range, naming the request)
        raise PlanError(f"kv_lens: more pages in all than int32 page offsets hold (longest {hi}, {B} requests)")
    if first_row < 0:
        fail_at("rows", rows < 0, "a page-table row is negative")
    backend = resolve_backend(spec, Mode.DECODE, B, B, 1, hi, None)
    plan = AttentionPlan.rows_decode(spec, rows, q, kv, hi, backend)
    object.__setattr__(plan, "sealed", True)
    return plan


def _finish(spec: AttentionSpec, step: StepArrays, *, block_table=None, rows=None, backend: str | None = None,
            own: dict | None = None, cascade: bool | None = None) -> AttentionPlan:
    """The layer groups' page ranges (own: those of groups with their own lists), the backend, the
    cascade (decode and verify steps of a spec with cascade on; `cascade` True forces it, False
    forbids it), and the sealed plan (shared by both batch forms)."""
    st = step
    q, kv, kv_indptr, kv_indices, lpl = st.q, st.kv, st.kv_indptr, st.kv_indices, st.last_page_len
    read_only(st.qo_indptr, kv_indptr, lpl, st.positions)
    groups = groups_of(spec, st, own)
    max_kv = int(kv.max()) if st.max_kv is None else st.max_kv
    levels, name = None, backend or spec.backend
    if spec.cascade_groups and kv_indices is not None and st.mode in (Mode.DECODE, Mode.VERIFY) and cascade is not False \
            and name in (*CASCADE_BACKENDS, AUTO):
        levels = plan_cascade(spec, q, kv, st.qo_indptr, kv_indptr, kv_indices, lpl, bool(cascade))
        if levels is not None and name == AUTO:
            backend = AUTO_CASCADE  # the GPU backend that runs cascades
    backend = resolve_backend(spec, st.mode, q.shape[0], st.num_tokens, st.q_max, max_kv, backend)
    plan = AttentionPlan(spec=spec, mode=st.mode, batch_size=q.shape[0], num_tokens=st.num_tokens, max_q_len=st.q_max,
                         max_kv_len=max_kv, q_lens=q, kv_lens=kv, qo_indptr=st.qo_indptr, kv_indptr=kv_indptr,
                         kv_indices=kv_indices, kv_last_page_len=lpl, positions=st.positions, slot_mapping=st.slot_mapping,
                         groups=groups, block_table=block_table, backend=backend, rows=rows, cascade=levels)
    object.__setattr__(plan, "sealed", True)
    return plan
