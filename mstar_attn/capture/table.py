"""The pool's page table: each request's pages, on the device with a host mirror, changed by what changed.

An engine keeps its requests in table rows: `assign` gives a row pages (admission, or growth by
several pages), `append` gives each of several rows one page (decode growth, one call per step),
`release` takes pages back (a finished request, or a rejected speculative tail). Each costs
O(pages changed). Steps then name rows (`StepRows`), and `GraphBufferPool.commit` turns the rows
into each backend's page arrays on the device, so a step costs O(batch + new tokens) on the host
whatever its contexts' lengths.

Ownership is enforced where pages are assigned, not per step: a page is free, held by one row
(exclusively), or shared read-only by several rows (a common prefix). A page can be held
exclusively only if it was free, and shared only if no row holds it exclusively. `check_step`
then only has to check, per step, that each page a step writes is held exclusively by the row
writing it: O(new tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn.metadata._arrays import INT32_MAX, INT32, Ranges, int_array, positive_int, within
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan, Mode
from mstar_attn.metadata.spec import AttentionSpec

FREE = -1  # owner of a page no row holds; a page shared by n rows has owner -1 - n
NO_UPDATES = np.zeros(0, np.int32)  # take_updates with none pending (read-only)
NO_UPDATES.flags.writeable = False
# append of at most this many rows runs on Python ints (CPU: 8 µs for one row, 28 for 16, ~1.3 a row more, against
# 41-45 µs for the vectorized path at any of these sizes)
APPEND_FEW = 16
# pending_in over at most this many touched and read rows together compares Python sets (np.isin sorts: tens of µs)
SHORT_SCAN = 256


def _ints(name: str, value) -> np.ndarray:
    """value as a 1-D int32 array: an int32 ndarray itself (read, never kept), else int_array's checked copy."""
    if type(value) is np.ndarray and value.dtype is INT32 and value.ndim == 1:
        return value
    return int_array(name, value, 1)


def _repeated(values: list) -> int:
    """The first of `values` that occurs again later in it (one must)."""
    seen = {}
    for i, v in enumerate(values):
        seen[v] = i  # (the last index of each)
    return next(v for i, v in enumerate(values) if seen[v] != i)


class PageTable:
    """max_requests rows of up to `width` page ids each (int32), in sequence order.

    host [max_requests + 1, width] int32 numpy, the mirror: row r's first counts[r] entries are its
    pages, the rest the scratch page (as is every entry of row max_requests, the scratch row that
    padding requests read). dev: the same on `device` plus one dump element at the end, brought up to
    date at each commit by a scatter of the entries changed since (8 bytes per page; `take_updates`).
    owner [num_pages + 1] int32: FREE, the row holding the page, or -1 - (rows sharing it); the
    scratch page's entry stays FREE, so no row ever holds it.
    Host memory: 4 bytes per page of the cache plus the mirror; device: the mirror's size.
    """

    def __init__(self, spec: AttentionSpec, max_requests: int, width: int, device: torch.device, name: str = "page table"):
        self.spec, self.name = spec, name
        self.max_requests = positive_int("max_requests", max_requests)
        self.width = positive_int("max_pages_per_request", width)
        if (self.max_requests + 1) * self.width + 1 > INT32_MAX:
            raise PlanError(f"max_requests x max_pages_per_request: {self.max_requests} x {self.width} table entries "
                            "are more than int32 positions address")
        self.scratch_row = self.max_requests
        shape = (self.max_requests + 1, self.width)
        self.host = np.full(shape, spec.scratch_page, np.int32)
        self.flat = self.host.reshape(-1)
        self.dev = torch.full((shape[0] * shape[1] + 1,), spec.scratch_page, dtype=torch.int32, device=device)
        self.dump = shape[0] * shape[1]  # the device element masked update lanes write
        self.counts = np.zeros(self.max_requests + 1, np.int32)
        self.stored = np.zeros(self.max_requests + 1, np.int32)  # a cross table's rows: encoder tokens stored (0: none)
        self.owner = np.full(spec.num_pages + 1, FREE, np.int32)
        self._pending: list[np.ndarray] = []  # flat positions changed since the last take_updates (_queue)
        self.pending = 0  # entries changed on the host and not yet sent to the device (their sum: repeats counted)
        self._stamp = np.zeros(self.max_requests, np.int32)  # check_step's distinct-rows check (a row past it: IndexError)
        self._arange = np.arange(self.max_requests + 1, dtype=np.int32)
        self.checked_rows = b""  # the rows (bytes) of the last step check_step passed: distinct table rows
        # per row, the tokens a decode step may write (tokens held alone, from the one after the last shared page):
        # kv_len (after the step) in low[r] .. low[r] + span[r] - 1 (span: uint32, 0 for none)
        self.low = np.ones(self.max_requests + 1, np.int32)
        self.span = np.zeros(self.max_requests + 1, np.uint32)
        self._ranges: tuple[bytes, Ranges | None] = (b"", None)  # (rows, their Ranges) of the last decode check, until a change
        self.changes = 0  # assign, append and release calls that changed a row so far (a steady commit's record: steady.py)
        self.reshapes = 0  # of those, the assign and release calls: what a steady commit cannot absorb (appends it can)

    def _queue(self, positions: np.ndarray) -> None:
        """Note flat positions changed on the host (int32 [n]) for the next take_updates."""
        if positions.shape[0]:
            self._pending.append(positions)
            self.pending += positions.shape[0]

    def pending_in(self, rows: np.ndarray) -> bool:
        """Whether an entry changed on the host and not yet sent to the device lies in one of `rows` ([B] int32 host,
        table rows): a step reading only other rows reads the device's table as the host has it."""
        if not self._pending:
            return False
        touched = (self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)) // self.width
        if touched.shape[0] + rows.shape[0] <= SHORT_SCAN:  # (a set's fixed cost is below np.isin's sort)
            return not set(touched.tolist()).isdisjoint(rows.tolist())
        return bool(np.isin(touched, rows).any())

    def _row(self, row, where: str) -> int:
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.max_requests:
            raise PlanError(f"{where}: row {row!r} is not a table row (0..{self.max_requests - 1})")
        return int(row)

    def _pages(self, pages, where: str) -> np.ndarray:
        p = int_array(f"{where}: pages", pages, 1)
        if p.shape[0] and (p.min() < 0 or p.max() >= self.spec.num_pages):
            bad = p[(p < 0) | (p >= self.spec.num_pages)][0]
            raise PlanError(f"{where}: page {bad} is outside the pool (pages 0..{self.spec.num_pages - 1})")
        return p

    def assign(self, row: int, pages, *, shared: bool = False) -> None:
        """Append `pages` (ids, in sequence order) to `row`'s list. shared=False: the row holds them
        alone, so each must be free. shared=True: read-only pages of a prefix other rows may hold
        too (as shared), never written by any step. PlanError (and nothing changed) otherwise."""
        row, p = self._row(row, "assign"), self._pages(pages, "assign")
        n, c = p.shape[0], int(self.counts[row])
        if c + n > self.width:
            raise PlanError(f"assign: row {row} would hold {c + n} pages, more than max_pages_per_request {self.width}")
        if n == 0:
            return
        if np.unique(p).shape[0] != n or (shared and np.isin(p, self.host[row, :c]).any()):
            raise PlanError(f"assign: row {row} is given some page twice")
        own = self.owner[p]
        taken = own >= 0 if shared else own != FREE
        if taken.any():
            page, o = int(p[taken][0]), int(own[taken][0])
            held = f"held by row {o}" if o >= 0 else f"shared by {-1 - o} rows"
            raise PlanError(f"assign: page {page} is {held}; " + ("a shared page may not be held by a row alone" if shared
                            else "a page a row holds alone must be free"))
        self.owner[p] = own - 1 if shared else row
        self.host[row, c : c + n] = p
        self.counts[row] = c + n
        if shared:  # (a decode step writes past the last shared page only)
            self.low[row] = (c + n) * self.spec.page_size + 1
        self._held(row)
        self._queue(np.arange(row * self.width + c, row * self.width + c + n, dtype=np.int32))

    def append(self, rows, pages) -> None:
        """Give each row rows[i] one more page, pages[i], held alone (decode growth: one call per step
        for every request whose next token starts a page). O(len(rows)); PlanError and nothing
        changed if a row repeats, is full or out of range, or a page is not free."""
        r, p = _ints("append: rows", rows), _ints("append: pages", pages)
        n = r.shape[0]
        if p.shape[0] != n:
            self._pages(p, "append")  # (a page outside the pool is named first)
            raise PlanError(f"append: {n} rows and {p.shape[0]} pages; give one page per row")
        if n == 0:
            return
        if n <= APPEND_FEW:  # (Python ints: cheaper than numpy's per-call cost for a few rows)
            rows, pages = r.tolist(), p.tolist()
            held, W, ps = self._append_check(rows, pages), self.width, self.spec.page_size
            owner, flat, counts, span = self.owner, self.flat, self.counts, self.span
            at = [row * W + k for row, k in zip(rows, held)]
            for row, page, k, a in zip(rows, pages, held, at):
                owner[page], flat[a], counts[row] = row, page, k + 1
                span[row] += ps
            pos = np.array(at, np.int32)
        else:
            c = self._append_counts(r, p)
            self.owner[p] = r
            pos = r * self.width
            pos += c
            self.flat[pos] = p
            self.counts[r] = c + 1
            self.span[r] += self.spec.page_size
        self._ranges = (b"", None)
        self.changes += 1
        self._queue(pos)

    def _append_check(self, rows: list, pages: list) -> list:
        """PlanError naming the first thing wrong with giving rows[i] page pages[i] (Python ints), in this order: a
        page outside the pool, a row outside the table, a full row, a page not free, a row twice, a page twice;
        else each row's page count now."""
        N, R, W = self.spec.num_pages, self.max_requests, self.width
        for page in pages:
            if not 0 <= page < N:
                raise PlanError(f"append: page {page} is outside the pool (pages 0..{N - 1})")
        for row in rows:
            if not 0 <= row < R:
                raise PlanError(f"append: row {row} is not a table row (0..{R - 1})")
        counts, owner = self.counts, self.owner
        held = [int(counts[row]) for row in rows]
        for row, k in zip(rows, held):
            if k >= W:
                raise PlanError(f"append: row {row} already holds max_pages_per_request {W} pages")
        for page in pages:
            if owner[page] != FREE:
                raise PlanError(f"append: page {page} is not free")
        if len(set(rows)) != len(rows):
            raise PlanError(f"append: row {_repeated(rows)} is given two pages in one call")
        if len(set(pages)) != len(pages):
            raise PlanError(f"append: page {_repeated(pages)} is given to two rows")
        return held

    def _append_counts(self, r: np.ndarray, p: np.ndarray) -> np.ndarray:
        """The page counts [n] of rows r [n] that pages p [n] (int32) may be appended to, checked vectorized; where a
        check fails, _append_check names the first failure (the same errors as for a few rows)."""
        n = r.shape[0]
        ok = p.min() >= 0 and p.max() < self.spec.num_pages and r.min() >= 0 and r.max() < self.max_requests
        if ok:
            c = self.counts[r]
            ok = (c.max() < self.width and (self.owner[p] == FREE).all() and np.unique(r).shape[0] == n
                  and np.unique(p).shape[0] == n)
        return c if ok else np.array(self._append_check(r.tolist(), p.tolist()), np.int32)

    def release(self, row: int, keep: int = 0) -> np.ndarray:
        """Take back row's pages past the first `keep` (all by default: the request left); returns them.
        Pages the row held alone become free; a shared page is freed when its last row lets go."""
        row = self._row(row, "release")
        c = int(self.counts[row])
        if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, (int, np.integer)) or not 0 <= keep <= c:
            raise PlanError(f"release: keep must be 0..{c} (the pages row {row} holds), got {keep!r}")
        p = self.host[row, keep:c].copy()
        own = self.owner[p]
        self.owner[p] = np.where(own >= 0, FREE, np.where(own == FREE - 1, FREE, own + 1))
        self.host[row, keep:c] = self.spec.scratch_page
        self.counts[row] = keep
        self.low[row] = min(int(self.low[row]), keep * self.spec.page_size + 1)
        self._held(row)
        self.stored[row] = min(int(self.stored[row]), keep * self.spec.page_size)
        self._queue(np.arange(row * self.width + keep, row * self.width + c, dtype=np.int32))
        return p

    def _held(self, row: int) -> None:
        """Row's decode range after its pages changed: kv_len low[row] .. counts[row] * page_size."""
        self.span[row] = max(int(self.counts[row]) * self.spec.page_size - int(self.low[row]) + 1, 0)
        self._ranges = (b"", None)
        self.changes += 1
        self.reshapes += 1

    def decode_ranges(self, rows: np.ndarray) -> Ranges:
        """Per request of a decode step over `rows` ([B] int32 table rows), kv_lens (after the step) for which the
        row holds alone the page its token lands on (Ranges [B]): only lengths check_step accepts of a decode step,
        and all of them for a row whose shared pages come first (a row given its own pages before shared ones may
        have more that check_step accepts)."""
        return Ranges(self.low[rows], self.span[rows])

    def holds_decode(self, rows: np.ndarray, kv_lens: np.ndarray) -> bool:
        """Whether decode_ranges(rows) holds kv_lens ([B] int32 host, B = rows.shape[0]), without making the Ranges:
        two gathers and the check Ranges.holds makes (_arrays.within)."""
        return within(kv_lens, self.low.take(rows), self.span.take(rows))

    def pages(self, row: int) -> np.ndarray:
        """A read-only copy of row's pages."""
        row = self._row(row, "pages")
        p = self.host[row, : self.counts[row]].copy()
        p.flags.writeable = False
        return p

    def take_updates(self) -> np.ndarray:
        """The flat positions changed since the last call (int32, repeats possible), and forget them.
        Their values are read from the mirror when sent, so a repeat carries the latest value."""
        if not self._pending:
            return NO_UPDATES
        pos = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        self._pending, self.pending = [], 0
        return pos

    def send(self, positions: np.ndarray) -> int:
        """Write the entries at `positions` (from take_updates) straight to the device table: for
        updates past a step's staged region (admissions). Returns the bytes sent (12 per entry)."""
        pos = torch.from_numpy(positions.astype(np.int64)).to(self.dev.device)
        self.dev.index_copy_(0, pos, torch.from_numpy(self.flat[positions]).to(self.dev.device))
        return positions.shape[0] * 12

    def restore_updates(self, positions: np.ndarray) -> None:
        """Put back positions take_updates returned (a commit that failed before sending them)."""
        if positions.shape[0]:
            self._pending.insert(0, positions)
            self.pending += positions.shape[0]

    def check_step(self, plan: AttentionPlan, slots: bool = True) -> np.ndarray | None:
        """PlanError unless `plan`'s rows are distinct table rows, each holding the pages its kv_len
        needs and holding alone each page the step writes; returns the step's slot_mapping [T] int64
        (None with slots=False: the device derives it, capture/derive.py). O(B + T): the mirror's
        unassigned entries are the scratch page, which no row holds, so the written page's owner
        check also proves the row holds enough pages."""
        rows, ps, B = plan.rows, self.spec.page_size, plan.batch_size
        key = rows.tobytes()
        if key != self.checked_rows:  # (the rows of the last step checked: distinct table rows already)
            self._check_distinct(rows, B)
            self.checked_rows = key
        if plan.max_kv_len > self.width * ps:  # (the last token of the longest request sits past the width)
            i = int(np.argmax(plan.kv_lens))
            raise PlanError(f"kv_lens: request {i} needs more than max_pages_per_request {self.width} pages")
        if plan.mode is Mode.DECODE:  # (from the lengths: a lazy plan's positions are not derived)
            if not slots:  # each row holds alone the page its token lands on iff its kv_len is in its range
                key_, ranges = self._ranges
                if key_ != key:
                    ranges = self.decode_ranges(rows)
                    self._ranges = (key, ranges)
                if ranges.holds(plan.kv_lens):
                    return None
            row_t, pos = rows, plan.kv_lens - 1  # (the exact check: its message, or a row past a shared page)
        else:
            row_t, pos = np.repeat(rows, plan.q_lens), plan.cache_positions
        page, bad = self.written(row_t, pos)
        if bad.any():
            t = int(np.flatnonzero(bad)[0])
            i = int(np.searchsorted(plan.qo_indptr, t, "right") - 1)
            r, c, own = int(row_t[t]), int(pos[t]) // ps, int(self.owner[page[t]])
            why = (f"holds {self.counts[r]} pages, fewer than kv_len {plan.kv_lens[i]} needs" if c >= self.counts[r] else
                   f"writes page {page[t]}, which it shares read-only" if own < FREE else
                   f"writes page {page[t]}, held by row {own}")
            raise PlanError(f"rows[{i}]: row {r} {why} (request {i})")
        return self.slots(page, pos) if slots else None

    def _check_distinct(self, rows: np.ndarray, B: int) -> None:
        """PlanError unless rows [B] are distinct table rows (build_plan refused negative ones)."""
        stamp, ar = self._stamp, self._arange[:B]
        try:
            stamp[rows] = ar
        except IndexError:
            i = int(np.flatnonzero(rows >= self.max_requests)[0])
            raise PlanError(f"rows[{i}]: row {rows[i]} is not a table row (0..{self.max_requests - 1}) (request {i})") from None
        twice = stamp[rows] != ar
        if twice.any():
            i = int(np.flatnonzero(twice)[0])
            raise PlanError(f"rows[{i}]: row {rows[i]} is listed twice in the step (request {i})")

    def written(self, row_t: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For tokens at positions pos [n] of rows row_t [n] (columns within the width): the page
        each lands on, and where that page is not held alone by its row (a write refused)."""
        at = row_t * self.width  # (int32: the table's entries fit int32, checked at construction)
        at += pos // self.spec.page_size
        page = self.flat[at]
        return page, self.owner[page] != row_t

    def slots_of(self, plan: AttentionPlan) -> np.ndarray:
        """slot_mapping [T] int64 of a StepRows plan's new tokens as this table holds its rows' pages now: the
        slots its commit wrote (what accepted_moves takes after a StepRows tree step; read before the table
        changes). PlanError for a plan over no table rows, or one whose rows no longer hold the pages its
        tokens were written to (check_step)."""
        if plan.rows is None:
            raise PlanError("slots_of: the plan lists its pages (a StepBatch plan): its slot_mapping holds its slots")
        return self.check_step(plan)  # (PlanError, naming the request, where a row no longer holds the page)

    def slots(self, page: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """slot_mapping [n] int64 of tokens at positions pos on pages `page`."""
        ps = self.spec.page_size
        slots = page.astype(np.int64)
        slots *= ps
        slots += pos % ps
        return slots

    def memory(self) -> dict[str, tuple[int, int]]:
        """Device bytes of the table (its pageable host side: host_bytes())."""
        return {self.name: (self.dev.numel() * 4, 0)}

    def host_bytes(self) -> int:
        """Host (not pinned) bytes: the mirror, counts and the page owners."""
        return (self.host.nbytes + self.counts.nbytes + self.stored.nbytes + self.owner.nbytes + self._stamp.nbytes
                + self._arange.nbytes + self.low.nbytes + self.span.nbytes)
