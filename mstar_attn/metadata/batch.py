"""The host-side description of one engine step, as an engine already holds it."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import attrs
import numpy as np

from mstar_attn.metadata._arrays import INT32_MAX, array_field, int_array, optional_array_field, packed_int32, positive_int
from mstar_attn.metadata.errors import PlanError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the batch sizes a pool pads decode / verify steps to by default


def bucket_of(batch_size: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """The smallest of the ascending `buckets` that holds batch_size requests, or None past the largest."""
    i = bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


_ONES = np.ones(1 << 16, np.int32)
_ONES.flags.writeable = False


def _ones(n: int) -> np.ndarray:
    """[n] int32 ones, read-only (a view for up to 65536)."""
    return _ONES[:n] if n <= _ONES.shape[0] else np.ones(n, np.int32)


def _vector(name: str):
    return array_field(converter=lambda x: int_array(name, x, 1))


def _table(x):
    return None if x is None else int_array("block_table", x, 2)


def _optional_vector(name: str):
    return optional_array_field(converter=lambda x: None if x is None else int_array(name, x, 1))


def _page_lists(name: str, pages) -> tuple[np.ndarray, np.ndarray]:
    """(indptr [B+1] int64, indices [n] int32) from one list of page ids per request, or PlanError."""
    if isinstance(pages, (str, bytes)) or not isinstance(pages, (Sequence, np.ndarray)) or (isinstance(pages, np.ndarray) and pages.ndim == 0):
        raise PlanError(f"{name}: expected one list of page ids per request, got {type(pages).__name__}")
    rows = []
    for i, p in enumerate(pages):
        if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
            raise PlanError(f"{name}[{i}]: expected a list of page ids for request {i}, got {p!r:.60}")
        rows.append(int_array(f"{name}[{i}]", p, 1, request=i))
    counts = np.fromiter((r.shape[0] for r in rows), np.int64, len(rows))
    indptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, (np.concatenate(rows) if rows else np.zeros(0, np.int32))


@attrs.frozen
class GroupPages:
    """The own page list of one layer group (LayerGroup.own_pages), B requests, host int32 arrays.

    first_page   [B]    the logical page (token position // page_size) each request's list starts
                        at: a window group's list may leave out the pages its window no longer sees
    page_indptr  [B+1]  CSR: request i lists page_indices[page_indptr[i]:page_indptr[i+1]]
    page_indices [n]    the pages of logical pages first_page[i], first_page[i] + 1, ... in order
                        (spare pages may follow); ids index the group's own caches

    build_plan checks that each list reaches back to the first key the step reads (for a window
    group, the last window + q_len - 1 keys) and forward to the request's KV length.

    A cross-attention group (Kind.CROSS, see `cross`) also gives:
    kv_lens  [B]  each request's encoder length (>= 1): the keys its decoder queries all see
    new_lens [B]  encoder tokens this step stores: kv_lens[i] for a request whose encoder K/V
                  write_kv(step, k, v, cache, group=g) writes this step (its first), else 0
    """

    first_page: np.ndarray = _vector("GroupPages.first_page")
    page_indptr: np.ndarray = _vector("GroupPages.page_indptr")
    page_indices: np.ndarray = _vector("GroupPages.page_indices")
    kv_lens: np.ndarray | None = _optional_vector("GroupPages.kv_lens")
    new_lens: np.ndarray | None = _optional_vector("GroupPages.new_lens")

    @classmethod
    def from_pages(cls, first_page, pages: Sequence) -> GroupPages:
        """From each request's first logical page and its list of page ids."""
        return cls(first_page, *_page_lists("GroupPages pages", pages))

    @classmethod
    def cross(cls, pages: Sequence, encoder_lens, write=None) -> GroupPages:
        """A cross-attention group's lists: each request's encoder K/V pages (from logical page 0)
        and encoder length; write [B] bool: the requests whose encoder K/V this step stores
        (default none: every request's encoder K/V were written at an earlier step)."""
        lens = int_array("GroupPages.kv_lens", encoder_lens, 1)
        new = _write_lens(lens, write, "GroupPages.cross")
        return cls(np.zeros_like(lens), *_page_lists("GroupPages pages", pages), lens, new)


def _write_lens(lens: np.ndarray, write, where: str) -> np.ndarray:
    """new_lens [B]: lens[i] where write[i] ([B] bools), else 0 (write None: all 0)."""
    if write is None:
        return np.zeros_like(lens)
    w = np.asarray(write)
    if w.dtype.kind not in "bi" or w.shape != lens.shape:
        raise PlanError(f"{where}: write must be [B] bools, one per request, got {w.dtype} {w.shape}")
    return np.where(w.astype(bool), lens, 0).astype(np.int32)


@attrs.frozen
class CrossRows:
    """A cross-attention group's encoder pages as rows of the pool's cross table
    (`GraphBufferPool.cross_table`, assigned once when a request's encoder runs), B requests:

    rows     [B]  each request's table row (requests may share one: the same encoder input)
    kv_lens  [B]  encoder lengths (>= 1)
    new_lens [B]  kv_lens[i] for a request whose encoder K/V this step stores, else 0

    Nothing here is O(pages): commit gathers the page lists on the device, so decode steps copy
    no cross page ids at all (see GraphBufferPool).
    """

    rows: np.ndarray = _vector("CrossRows.rows")
    kv_lens: np.ndarray = _vector("CrossRows.kv_lens")
    new_lens: np.ndarray = _vector("CrossRows.new_lens")

    @classmethod
    def of(cls, rows, encoder_lens, write=None) -> CrossRows:
        lens = int_array("CrossRows.kv_lens", encoder_lens, 1)
        return cls(rows, lens, _write_lens(lens, write, "CrossRows.of"))


def _group_pages(value) -> tuple:
    """{group index: GroupPages or CrossRows} (or pairs) -> a tuple of (group, lists) sorted by group."""
    if value is None:
        return ()
    items = value.items() if hasattr(value, "items") else value
    try:
        pairs = [(g, p) for g, p in items]
    except (TypeError, ValueError):
        raise PlanError(f"group_pages: expected {{layer group index: GroupPages}}, got {type(value).__name__}") from None
    for g, p in pairs:
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g < 0:
            raise PlanError(f"group_pages: keys are layer-group indices, got {g!r}")
        if not isinstance(p, (GroupPages, CrossRows)):
            raise PlanError(f"group_pages[{g}]: expected a GroupPages (or a cross group's CrossRows), got {type(p).__name__}")
    if len({int(g) for g, _ in pairs}) != len(pairs):
        raise PlanError("group_pages: a layer group is given twice")
    return tuple(sorted(((int(g), p) for g, p in pairs), key=lambda x: x[0]))


@attrs.frozen
class StepBatch:
    """One step's requests, all host (numpy) int32 arrays, B requests.

    q_lens      [B]      new query tokens of each request this step (>= 1)
    kv_lens     [B]      KV length of each request *after* this step (cached prefix + new tokens)
    page_indptr [B + 1]  CSR page table: request i lists page_indices[page_indptr[i]:page_indptr[i+1]]
    page_indices[nnz]    page ids, in sequence order; a request may list more pages than it uses
    block_table [B, P]   padded page table, when the engine holds one (row i, first pages used)
    page_size            tokens per page, must equal the cache's
    group_pages          {group: GroupPages}: the own list of each layer group with own_pages (a
                         hybrid model's window groups); the other groups read the lists above

    Build with `from_csr` or `from_block_table`, whichever the engine holds: the planner
    reads the CSR form, and keeps the block table for backends that want one. The batch
    copies its inputs once into read-only int32 arrays (the engine may then mutate its own;
    int32 input skips the value scan), and plans built from it share those arrays.
    Malformed input (non-integer dtypes, wrong ranks, values outside int32) raises PlanError
    naming the field; build_plan checks what the values mean.
    """

    q_lens: np.ndarray = _vector("q_lens")
    kv_lens: np.ndarray = _vector("kv_lens")
    page_indptr: np.ndarray = _vector("page_indptr")
    page_indices: np.ndarray = _vector("page_indices")
    page_size: int = attrs.field(converter=lambda x: positive_int("page_size", x))
    block_table: np.ndarray | None = optional_array_field(converter=_table)
    group_pages: tuple[tuple[int, GroupPages], ...] = attrs.field(default=(), converter=_group_pages)
    # from_csr / from_pages: the one read-only int32 array [3B + 1 + n] whose views the four vectors above are, back
    # to back in their order (what native.exact_lists reads); None for a batch made otherwise (copies of their own)
    packed: np.ndarray | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @classmethod
    def from_csr(cls, q_lens, kv_lens, page_indptr, page_indices, page_size: int, group_pages=None) -> StepBatch:
        if type(page_size) is int and 0 < page_size <= INT32_MAX and (
                packed := packed_int32(arrays := (q_lens, kv_lens, page_indptr, page_indices))) is not None:
            return _pack(cls, packed, arrays, page_size, group_pages)
        return cls(q_lens, kv_lens, page_indptr, page_indices, page_size, None, group_pages)

    @classmethod
    def from_block_table(cls, q_lens, kv_lens, block_table, page_size: int, group_pages=None) -> StepBatch:
        """Keeps the block table and derives the CSR of the pages each request uses."""
        table = int_array("block_table", block_table, 2)
        kv = int_array("kv_lens", kv_lens, 1)
        ps = positive_int("page_size", page_size)
        if table.shape[0] != kv.shape[0]:
            raise PlanError(f"block_table: expected [B={kv.shape[0]}, max_pages], got shape {table.shape}")
        need = (kv.astype(np.int64) + (ps - 1)) // ps
        used = np.clip(need, 0, table.shape[1]).astype(np.int32)
        indptr = np.zeros(kv.shape[0] + 1, np.int32)
        np.cumsum(used, out=indptr[1:])
        indices = table[np.arange(table.shape[1]) < used[:, None]]
        return cls(q_lens, kv, indptr, indices, ps, table, group_pages)

    @classmethod
    def from_pages(cls, q_lens, kv_lens, pages: Sequence, page_size: int, group_pages=None) -> StepBatch:
        """From one list of page ids per request (tests and small engines)."""
        indptr, indices = _page_lists("pages", pages)
        if indptr[-1] > INT32_MAX:  # (the constructor names it)
            return cls(q_lens, kv_lens, indptr, indices, page_size, None, group_pages)
        return cls.from_csr(int_array("q_lens", q_lens, 1), int_array("kv_lens", kv_lens, 1), indptr.astype(np.int32),
                            indices, page_size, group_pages)

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]

    def pages_of_group(self, group: int) -> GroupPages | None:
        """The own list of layer group `group`, or None (it reads the shared list)."""
        return next((p for g, p in self.group_pages if g == group), None)


def _pack(cls, packed: np.ndarray, arrays: tuple, page_size: int, group_pages) -> StepBatch:
    """A StepBatch of four int32 vectors (q_lens, kv_lens, page_indptr, page_indices), field for field what the
    constructor makes of them, from `packed`, their one copy (packed_int32): read-only views of one read-only array
    (the per-step path of an engine that lists its pages: numpy's fixed cost per call is most of what small arrays
    cost)."""
    batch, at = object.__new__(cls), 0
    for name, a in zip(("q_lens", "kv_lens", "page_indptr", "page_indices"), arrays):
        object.__setattr__(batch, name, packed[at : at + a.shape[0]])
        at += a.shape[0]
    object.__setattr__(batch, "page_size", page_size)
    object.__setattr__(batch, "block_table", None)
    object.__setattr__(batch, "group_pages", _group_pages(group_pages))
    object.__setattr__(batch, "packed", packed)
    return batch


@attrs.frozen(slots=False)  # (an instance dict: decode writes it at once)
class StepRows:
    """One step over a pool's page table (`GraphBufferPool.table`), all host int32 arrays, B requests.

    rows    [B]  the table row of each request: distinct, each holding the request's pages
    q_lens  [B]  new query tokens of each request this step (>= 1)
    kv_lens [B]  KV length of each request *after* this step (cached prefix + new tokens)

    Nothing here is O(pages): the pages stay in the table, which the pool turns into each
    backend's page arrays on the device. build_plan checks the lengths and that rows are distinct;
    commit checks each row holds enough pages and owns the pages the step writes.
    """

    rows: np.ndarray = _vector("rows")
    q_lens: np.ndarray = _vector("q_lens")
    kv_lens: np.ndarray = _vector("kv_lens")
    # True only for steps `decode` made (q_lens all 1 by construction, so build_plan need not scan them);
    # attrs.evolve and the constructor leave it False
    decode_step: bool = attrs.field(init=False, default=False, eq=False, repr=False)
    # decode: the one read-only int32 array [2B] whose views rows and kv_lens are, back to back (native.rows_decode
    # reads it); None for a step made otherwise
    packed: np.ndarray | None = attrs.field(init=False, default=None, eq=False, repr=False)

    @classmethod
    def decode(cls, rows, kv_lens) -> StepRows:
        """A decode step: one new token per request."""
        # read-only copies, as the fields' converters make, in their order (rows first: the same error when both are
        # wrong); set without converting again; int32 input: views of one copy (packed)
        packed = packed_int32((rows, kv_lens))
        if packed is not None:
            B = rows.shape[0]
            rows, kv = packed[:B], packed[B:]
        else:
            rows, kv = int_array("rows", rows, 1), int_array("kv_lens", kv_lens, 1)
        step = object.__new__(cls)
        step.__dict__.update(rows=rows, q_lens=_ones(kv.shape[0]), kv_lens=kv, decode_step=True, packed=packed)
        return step

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]
