"""The plan record: `Mode` and the frozen `AttentionPlan`, and the pure function a StepRows decode
plan derives its arrays with on first read. Numpy only, host only (see plan.py for build_plan)."""

from __future__ import annotations

import enum

import attrs
import numpy as np

from mstar_attn.metadata._arrays import SHORT, array_field, short_page_spans, nullable_array_field, optional_array_field, read_only
from mstar_attn.metadata.cascade import CascadePlan
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.groups import GroupPlan, StepArrays, first_read_page, window_plan
from mstar_attn.metadata.spec import AttentionSpec, Kind
from mstar_attn.metadata.tree import DraftTree

__all__ = ["MAX_VERIFY_Q_LEN", "AttentionPlan", "Mode", "decode_qo_indptr", "groups_of", "decode_arrays"]

MAX_VERIFY_Q_LEN = 16  # the longest uniform q_len a step may have and still be a VERIFY step (a token-tree step: MAX_TREE_NODES)


class Mode(enum.Enum):
    """What a step is, by its shape alone (q_len, cached prefix = kv_len - q_len, per request).

    DECODE   every request has q_len 1.
    PREFILL  no request has a cached prefix, and some q_len > 1.
    VERIFY   every request has the same q_len, 2 <= q_len <= MAX_VERIFY_Q_LEN, over a cached
             prefix: speculative verify and draft steps (and any short uniform chunk, which the
             kernels serve the same way). Pools bucket these like decode steps. A token-tree
             verify step (build_tree_plan) of one tree size over cached prefixes is one too, its
             size up to MAX_TREE_NODES (pools bucket it up to PoolLimits.max_tree_nodes).
    MIXED    decode requests (q_len 1) beside longer ones, some over a cached prefix.
    EXTEND   anything else: chunked prefill, prefix-cache hits, long uniform chunks.
    """

    __hash__ = object.__hash__  # (members compare by identity; Enum's own __hash__ is Python code, paid per dict lookup)

    DECODE = "decode"
    PREFILL = "prefill"
    VERIFY = "verify"
    MIXED = "mixed"
    EXTEND = "extend"


def _array_arg(name: str):
    """A plan array given at construction (build_plan's eager paths), or None: a StepRows decode plan,
    which derives it from its lengths on first read (`_lazy`)."""
    return attrs.field(default=None, alias=name, eq=False, repr=False)


@attrs.frozen(eq=False, kw_only=True, slots=False)  # (instance dicts: see rows_decode)
class AttentionPlan:
    """Everything any backend needs for one step, B requests and T new tokens, host arrays.

    qo_indptr [B+1] int32     new tokens of request i are rows qo_indptr[i]:qo_indptr[i+1] of q
    q_lens, kv_lens [B] int32 kv_lens is after the step (prefix + new tokens)
    kv_indptr [B+1], kv_indices [n], kv_last_page_len [B] int32: the pages each request reads
    positions [T] int64       absolute position of each new token
    slot_mapping [T] int64    page * page_size + offset where token t's K/V is written (for the
                              groups reading the shared list; an own_pages group has its own,
                              groups[g].slot_mapping: `slots_of(g)` gives either)
    block_table [B, P] int32  the engine's padded page table, when it gave one (else None)
    rows [B] int32            a StepRows plan's page-table rows (else None). Such a plan holds no
                              page ids: kv_indices and slot_mapping (plan and groups) are None, and
                              GraphBufferPool.commit derives them from its table.
    groups                    one GroupPlan per spec.groups entry
    cascade                   the step's shared-prefix levels (spec.cascade; metadata/cascade.py), run
                              by spec.cascade_groups, or None: every group reads flat
    backend                   the backend that serves the step: spec.backend, or the choice of
                              select_backend when spec.backend is "auto"

    A StepRows decode plan holds only its lengths and rows: qo_indptr, kv_indptr, kv_last_page_len,
    positions and groups are derived from them by a pure function on first read (positions and
    qo_indptr each on its own; a pool derives them all on the device instead), the same arrays an
    eager plan holds, kept in a cache attrs.evolve does not copy. Plans compare by value; fields by
    keyword only.
    """

    spec: AttentionSpec = attrs.field(repr=False)
    mode: Mode
    batch_size: int
    num_tokens: int
    max_q_len: int
    max_kv_len: int
    q_lens: np.ndarray = array_field()
    kv_lens: np.ndarray = array_field()
    kv_indices: np.ndarray | None = nullable_array_field()
    block_table: np.ndarray | None = optional_array_field()
    backend: str = "flashinfer"  # the BACKENDS name that serves this step
    rows: np.ndarray | None = optional_array_field()  # StepRows plans: each request's page-table row
    # step j of a draft round (metadata/draft.py), else None: its page lists run ahead of its lengths
    # (kv_last_page_len may be <= 0); commit it with GraphBufferPool.commit_round, never alone
    draft_step: int | None = None
    cascade: CascadePlan | None = attrs.field(default=None, repr=False)
    # a verify step of draft token trees (metadata/tree.py: build_tree_plan), else None: each new token
    # attends to its own ancestors among the new tokens, not to every earlier one; positions by depth
    tree: DraftTree | None = attrs.field(default=None, repr=False)
    _qo_indptr: np.ndarray | None = _array_arg("qo_indptr")
    _kv_indptr: np.ndarray | None = _array_arg("kv_indptr")
    _kv_last_page_len: np.ndarray | None = _array_arg("kv_last_page_len")
    _positions: np.ndarray | None = _array_arg("positions")
    _slot_mapping: np.ndarray | None = _array_arg("slot_mapping")
    _groups: tuple[GroupPlan, ...] | None = _array_arg("groups")
    # a lazy decode plan's cross group, given (lists_decode): the GroupPlan of its cross-table rows, storing nothing
    _lazy_cross: GroupPlan | None = attrs.field(default=None, alias="lazy_cross", eq=False, repr=False)
    _cache: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)  # a lazy plan's derived arrays
    # True only for plans build_plan / scratch_plan made: attrs.evolve makes a new plan through
    # __init__, which leaves this False, so a hand-edited plan is never taken for a checked one
    sealed: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    qo_indptr = property(lambda self: self._array("qo_indptr"), doc="[B+1] int32 (see the class doc)")
    kv_indptr = property(lambda self: self._array("kv_indptr"), doc="[B+1] int32")
    kv_last_page_len = property(lambda self: self._array("kv_last_page_len"), doc="[B] int32")
    positions = property(lambda self: self._array("positions"), doc="[T] int64")
    slot_mapping = property(lambda self: self._array("slot_mapping"), doc="[T] int64, or None (a StepRows plan)")
    groups = property(lambda self: self._array("groups"), doc="tuple[GroupPlan, ...], one per layer group")

    @classmethod
    def rows_decode(cls, spec: AttentionSpec, rows: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                    max_kv_len: int, backend: str) -> AttentionPlan:
        """The lazy plan of a StepRows decode step (B = rows.shape[0] requests, one token each), field for field
        what __init__ makes of these arguments (build_plan's per-step path: one dict write instead of a call per
        field; not sealed: build_plan seals what it checked)."""
        B = kv_lens.shape[0]
        plan = object.__new__(cls)
        plan.__dict__.update(_DECODE_DEFAULTS, spec=spec, batch_size=B, num_tokens=B, max_kv_len=max_kv_len,
                             q_lens=q_lens, kv_lens=kv_lens, backend=backend, rows=rows, _cache={})
        return plan

    @classmethod
    def listed_decode(cls, spec: AttentionSpec, st: StepArrays, groups: tuple, backend: str) -> AttentionPlan:
        """The plan of a decode step that lists its pages (build_plan's per-step path for a StepBatch): field for
        field what __init__ makes of st's arrays (StepArrays of a decode step, max_kv given), the groups and the
        backend, in one dict write (not sealed: build_plan seals what it checked)."""
        plan = object.__new__(cls)
        plan.__dict__.update(_DECODE_DEFAULTS, spec=spec, batch_size=st.num_tokens, num_tokens=st.num_tokens,
                             max_kv_len=st.max_kv, q_lens=st.q, kv_lens=st.kv, kv_indices=st.kv_indices,
                             _slot_mapping=st.slot_mapping, backend=backend, _qo_indptr=st.qo_indptr,
                             _kv_indptr=st.kv_indptr, _kv_last_page_len=st.last_page_len, _positions=st.positions,
                             _groups=groups, _cache={})
        return plan

    @classmethod
    def lists_decode(cls, spec: AttentionSpec, q_lens: np.ndarray, kv_lens: np.ndarray, kv_indptr: np.ndarray,
                     kv_indices: np.ndarray, max_kv_len: int, backend: str, cross: GroupPlan | None = None) -> AttentionPlan:
        """The lazy plan of a decode step that lists exactly its pages (build_plan's per-step path for a StepBatch
        whose groups read the shared list, but a cross group of cross-table rows: `cross`, its GroupPlan, storing
        nothing): its lengths, kv_indptr [B+1] and kv_indices (the pages each length needs, from logical page 0);
        every other array derived on first read (a pool derives them on the device instead). Field for field what
        __init__ makes of these arguments, in one dict write (not sealed)."""
        B = kv_lens.shape[0]
        plan = object.__new__(cls)
        plan.__dict__.update(_DECODE_DEFAULTS, spec=spec, batch_size=B, num_tokens=B, max_kv_len=max_kv_len,
                             q_lens=q_lens, kv_lens=kv_lens, kv_indices=kv_indices, backend=backend,
                             _kv_indptr=kv_indptr, _lazy_cross=cross, _cache={})
        return plan

    @property
    def lazy_cross(self) -> GroupPlan | None:
        """A lazy decode plan's cross group (spec.own_page_groups[0]), given at construction: the GroupPlan of its
        cross-table rows, storing nothing; None for any other plan (an eager plan holds its cross groups in groups)."""
        return self._lazy_cross

    def group_plan(self, group: int) -> GroupPlan:
        """groups[group], without deriving a lazy plan's other arrays where it is the plan's given cross group."""
        c = self._lazy_cross
        return c if c is not None and group == self.spec.own_page_groups[0] else self.groups[group]

    @property
    def lazy(self) -> bool:
        """Whether this plan was built without its arrays (a decode plan of StepRows, or of a StepBatch listing
        exactly its pages: they are derived on read)."""
        return self._groups is None

    @property
    def arrays_derived(self) -> bool:
        """Whether every array is held: an eager plan, or a lazy one whose groups were read."""
        return self._groups is not None or "groups" in self._cache

    def _array(self, name: str):
        """Array `name`: as given at construction, else derived (`_lazy`)."""
        given = getattr(self, "_" + name)
        return given if given is not None else self._lazy(name)

    def _lazy(self, name: str):
        """A lazy decode plan's array `name`, derived on first read (positions and qo_indptr alone, the rest
        together: `decode_arrays`; a plan that lists its pages: slot_mapping and groups over its lists too); a
        StepRows plan's slot_mapping is None; PlanError for a plan that holds no such array otherwise."""
        got = self._cache.get(name)
        if got is not None:
            return got
        if name == "slot_mapping" and (self.rows is not None or self._groups is not None):
            return None  # (a StepRows plan: the pool derives its slots)
        if self.mode is not Mode.DECODE or self._groups is not None or (
                self.rows is None and (self.kv_indices is None or self._kv_indptr is None)):
            raise PlanError(f"AttentionPlan.{name}: this plan holds none, and only a lazy decode plan derives its "
                            "arrays from its lengths: make plans with build_plan (a hand-made plan lists them all)")
        kv, c = self.kv_lens, self._cache
        if name == "positions":
            got = c[name] = np.subtract(kv, 1, dtype=np.int64)
            got.flags.writeable = False
        elif name == "qo_indptr":
            got = c[name] = decode_qo_indptr(kv.shape[0])
        else:
            step = decode_arrays(self.spec, self.q_lens, kv, self.max_kv_len)
            c.setdefault("positions", step.positions)
            c.setdefault("qo_indptr", step.qo_indptr)
            if self.kv_indices is not None:  # (its lists: the pages of each length, from logical page 0)
                step.kv_indptr, step.kv_indices = self._kv_indptr, self.kv_indices
                step.slot_mapping = c["slot_mapping"] = listed_slots(written_pages(self.kv_indices, step.kv_indptr),
                                                                     step.last_page_len, self.spec.page_size)
            own = None if self._lazy_cross is None else {self.spec.own_page_groups[0]: self._lazy_cross}
            c["kv_indptr"], c["kv_last_page_len"], c["groups"] = step.kv_indptr, step.last_page_len, groups_of(self.spec, step, own)
            got = c[name]
        return got

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        if not all(_same(getattr(self, n), getattr(other, n)) for n in _STORED):
            return False
        # a lazy plan's derived arrays are a pure function of the stored fields: two lazy plans compare the arrays
        # either was given (an evolved plan's), an eager plan every array
        both_lazy = self.lazy and other.lazy
        if both_lazy and not _same(self.lazy_cross, other.lazy_cross):
            return False
        return all(_same(getattr(self, n), getattr(other, n)) for n in _DERIVED
                   if not both_lazy or getattr(self, "_" + n) is not None or getattr(other, "_" + n) is not None)

    def kv_lens_of(self, group: int) -> np.ndarray:
        """kv_lens [B] of layer group `group` (its own for window, cross and own-list groups), without
        deriving a lazy plan's other arrays (a window group's lengths: computed alone)."""
        g = self.spec.groups[group]
        if self.arrays_derived or g.cross:  # (a lazy plan's cross group: given, group_plan)
            return self.group_plan(group).kv_lens
        if g.kind is not Kind.WINDOW:  # (a lazy plan: StepRows decode, no own groups)
            return self.kv_lens
        kv = self.kv_lens
        return kv - first_read_page(g, self.q_lens, kv, self.spec.page_size) * self.spec.page_size

    @property
    def cache_positions(self) -> np.ndarray:
        """[T] int64: where each new token's K/V sits in its request's sequence, kv_len - q_len plus its index
        among the request's new tokens (the slots a step writes): `positions`, except in a token-tree step,
        whose `positions` are by depth (the RoPE positions) while its tokens are stored in tree order."""
        if self.tree is None:
            return self.positions
        got = self._cache.get("cache_positions")
        if got is None:
            got = self._cache["cache_positions"] = new_token_positions(self.q_lens, self.kv_lens, self.qo_indptr)
            got.flags.writeable = False
        return got

    @property
    def sm_scale(self) -> float:
        return self.spec.sm_scale

    @property
    def soft_cap(self) -> float:
        return self.spec.soft_cap

    @property
    def causal(self) -> bool:
        """Whether the first layer group is causal; each GroupPlan carries its own."""
        return self.spec.groups[0].causal

    def group_for_layer(self, layer: int) -> GroupPlan:
        return self.groups[self.spec.group_of(layer)]

    def stored_rows(self, group: int) -> int:
        """The new K/V rows a layer of `group` stores this step: every token (T), or for a cross group
        the encoder tokens it stores this step (0 at a step that stores none)."""
        if not self.spec.groups[group].cross:  # (no derived arrays read: a lazy decode plan stays lazy)
            return self.num_tokens
        return self.group_plan(group).stored

    def slots_of(self, group: int) -> np.ndarray | None:
        """slot_mapping [T] int64 of layer group `group`: its own (own_pages) or the plan's."""
        own = self.groups[group].slot_mapping
        return self.slot_mapping if own is None else own


# the fields rows_decode / listed_decode / lists_decode do not take, as __init__ sets them for a decode plan (tests/metadata/test_record.py)
_DECODE_DEFAULTS = {**{a.name: a.default for a in attrs.fields(AttentionPlan) if a.default is not attrs.NOTHING
                       and not isinstance(a.default, attrs.Factory)},
                    "mode": Mode.DECODE, "max_q_len": 1, "kv_indices": None}

_STORED = ("spec", "mode", "batch_size", "num_tokens", "max_q_len", "max_kv_len", "q_lens", "kv_lens", "kv_indices",
           "block_table", "backend", "rows", "draft_step", "cascade", "tree")
_DERIVED = ("qo_indptr", "kv_indptr", "kv_last_page_len", "positions", "slot_mapping", "groups")


def written_pages(kv_indices: np.ndarray, kv_indptr: np.ndarray) -> np.ndarray:
    """A decode step's written pages [B] int32: each request's last listed page (kv_indptr [B+1], kv_indices int32)."""
    return kv_indices[kv_indptr[1:] - 1]


def listed_slots(written: np.ndarray, last_page_len: np.ndarray, ps: int) -> np.ndarray:
    """A decode step's slot_mapping [B] int64 (read-only) from its written pages [B] (written_pages): each request's
    one new token goes to its last listed page, at that page's last_page_len [B] - 1."""
    out = np.multiply(written, ps, dtype=np.int64)
    out += last_page_len
    out -= 1
    out.flags.writeable = False
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and np.array_equal(a, b)
    return a == b


ARANGE = np.arange(1 << 16, dtype=np.int32)  # qo_indptr of decode steps up to 65535 requests: read-only views
read_only(ARANGE)

def new_token_positions(q: np.ndarray, kv: np.ndarray, qo_indptr: np.ndarray) -> np.ndarray:
    """[T] int64: each new token's position in its request's sequence, kv_len - q_len plus its index among the
    request's new tokens (q, kv [B] int32; qo_indptr [B+1] int32, T = qo_indptr[-1]). A new, writable array."""
    out = np.repeat((kv - q - qo_indptr[:-1]).astype(np.int64), q)
    out += np.arange(out.shape[0])
    return out


def decode_qo_indptr(B: int) -> np.ndarray:
    """qo_indptr [B+1] int32 of a decode step (0, 1, ..., B), read-only."""
    if B < ARANGE.shape[0]:
        return ARANGE[: B + 1]
    out = np.arange(B + 1, dtype=np.int32)
    out.flags.writeable = False
    return out


def decode_arrays(spec: AttentionSpec, q: np.ndarray, kv: np.ndarray, max_kv: int,
                  lengths: list[int] | None = None) -> StepArrays:
    """The arrays of a decode step [B] from its KV lengths (read-only; no page ids): what build_plan holds for a
    StepRows step, and what capture/derive.py derives on the device; a StepBatch decode step listing exactly these
    pages has the same ones (its page_indptr is this kv_indptr). lengths: kv as Python ints, when the caller has
    them already (read by the short path)."""
    B, ps = kv.shape[0], spec.page_size
    if B <= SHORT:  # (Python ints and one array: numpy's fixed cost per call is higher than a short loop)
        kv_indptr, last_page_len, need = short_page_spans(kv.tolist() if lengths is None else lengths, ps)
        positions = np.subtract(kv, 1, dtype=np.int64)
        read_only(positions)
        return StepArrays(mode=Mode.DECODE, q=q, kv=kv, num_tokens=B, q_max=1, qo_indptr=decode_qo_indptr(B),
                          positions=positions, need=need, kv_indptr=kv_indptr, last_page_len=last_page_len, max_kv=max_kv)
    need = kv + (ps - 1)
    need //= ps
    kv_indptr = np.empty(B + 1, np.int32)
    kv_indptr[0] = 0
    np.cumsum(need, out=kv_indptr[1:])
    positions = np.subtract(kv, 1, dtype=np.int64)
    last_page_len = kv - 1
    last_page_len %= ps
    last_page_len += 1
    read_only(kv_indptr, positions, last_page_len)
    return StepArrays(mode=Mode.DECODE, q=q, kv=kv, num_tokens=B, q_max=1, qo_indptr=decode_qo_indptr(B), positions=positions,
                      need=need, kv_indptr=kv_indptr, last_page_len=last_page_len, max_kv=max_kv)


def groups_of(spec: AttentionSpec, st: StepArrays, own: dict | None = None) -> tuple[GroupPlan, ...]:
    """One GroupPlan per layer group: own[i] for groups with their own lists, the shared list's
    ranges (a window group: trimmed) for the others."""
    own = own or {}
    return tuple([
        own[i] if i in own
        else GroupPlan(g, st.kv_indptr, st.kv_indices, st.last_page_len, st.kv) if g.kind is not Kind.WINDOW
        else window_plan(g, st.kv_indptr, st.kv_indices, st.last_page_len, st.q, st.kv, st.need, spec.page_size)
        for i, g in enumerate(spec.groups)
    ])


