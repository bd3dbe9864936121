"""Page-list helpers of the CSR planner: range gathers and the ownership scan. Pure numpy."""

from __future__ import annotations

import numpy as np

from mstar_attn.metadata._arrays import read_only
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.spec import AttentionSpec

LISTED_SHORT = 256  # an ownership scan over at most this many listed pages runs on a set of Python ints
# past it, a pool of fewer pages than this (or than 4 per listed page) gets a boolean table over every page id (128 KB:
# one allocation numpy fills at once, no fresh pages to map); larger pools a hashed table (written_hits)
DIRECT_PAGES = 1 << 17


def gather_ranges(src: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate src[starts[i] : starts[i] + counts[i]] over i; returns (indptr [B+1], values)."""
    indptr = np.zeros(counts.shape[0] + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    offsets = np.repeat(starts - indptr[:-1], counts)
    offsets += np.arange(indptr[-1], dtype=np.int32)
    values = src[offsets]
    read_only(indptr, values)
    return indptr, values


def request_of(indptr: np.ndarray, flat: np.ndarray) -> np.ndarray:
    return np.searchsorted(indptr, flat, side="right") - 1


def check_indptr(field: str, indptr: np.ndarray, n_listed: int) -> None:
    """PlanError unless `indptr` [B+1] (of the list `field`) starts at 0, never decreases and stays
    within the n_listed page ids; a decrease names the request."""
    if indptr[0] != 0 or indptr.min() < 0 or indptr.max() > n_listed:
        raise PlanError(f"{field} must start at 0 and stay within its page_indices (length {n_listed}), "
                        f"got {indptr[0]}..{indptr[-1]} (min {indptr.min()}, max {indptr.max()})")
    down = indptr[1:] < indptr[:-1]
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise PlanError(f"{field}[{i + 1}]: decreases ({indptr[i]} then {indptr[i + 1]}) (request {i})")


def check_page_ids(spec: AttentionSpec, field: str, indptr: np.ndarray, listed: np.ndarray, page_limit: int) -> None:
    """PlanError naming the request unless every listed page id is in 0..page_limit - 1 (num_pages,
    or num_pages + 1 for scratch plans): inside the cache and, for engine steps, off the scratch page."""
    if listed.shape[0] and (listed.min() < 0 or listed.max() >= page_limit):
        j = int(np.flatnonzero((listed < 0) | (listed >= page_limit))[0])
        i = int(request_of(indptr, np.array([j]))[0])
        what = "the scratch page, which no request may list" if listed[j] == spec.scratch_page else "outside the pool"
        raise PlanError(f"{field}: request {i} lists page {listed[j]}, {what} (pages 0..{spec.num_pages - 1})")


def written_hits(listed: np.ndarray, ordered: np.ndarray) -> int:
    """How many entries of `listed` are pages of `ordered` (the written pages, sorted, distinct): a table of a
    power of two >= 4 * len(listed) slots indexed by page id modulo its size, whose few hits (the written pages,
    plus ~len(ordered) / 4 collisions) are then checked exactly. O(pages listed + pages written), never O(pool size)."""
    size = 1 << max(4 * listed.shape[0] - 1, 1).bit_length()
    table = np.zeros(size, np.bool_)
    table[ordered & (size - 1)] = True
    candidates = listed[table.take(listed & (size - 1))]
    at = np.minimum(np.searchsorted(ordered, candidates), ordered.shape[0] - 1)
    return int(np.count_nonzero(ordered[at] == candidates))


def scan_ownership(spec: AttentionSpec, indptr, listed: np.ndarray, written: np.ndarray,
                   field: str = "page_indices") -> None:
    """A page written this step must appear exactly once among all pages the step lists.

    listed: every request's whole page list (spare pages included); written [n]: each request's
    written pages, once each. Pages only read (a shared prefix) may be listed by several requests.
    No page may repeat in `written` (two writers), and since each written page is listed once by
    its writer, the listed entries that hit a written page must number exactly n: any excess is
    another request listing it (to read it, write it, or hold it as a spare). O(pages listed + n log n), or with a
    table over every page id (a pool of at most DIRECT_PAGES, or 4 per listed page) O(pages listed + pool size).
    """
    n, listed_n = written.shape[0], listed.shape[0]
    if listed_n <= LISTED_SHORT:  # (a set of Python ints: cheaper than numpy's fixed cost per call)
        writers = set(written.tolist())
        if len(writers) == n and sum(map(writers.__contains__, listed.tolist())) == n:
            return
    elif spec.num_pages <= max(DIRECT_PAGES, 4 * listed_n):  # (+1: a scratch plan lists the scratch page)
        table = np.zeros(spec.num_pages + 1, np.bool_)
        table[written] = True
        if np.count_nonzero(table) == n and np.count_nonzero(table.take(listed)) == n:  # (distinct, listed once)
            return
    else:
        ordered = np.sort(written)
        if not (ordered[1:] == ordered[:-1]).any() and written_hits(listed, ordered) == n:
            return
    ordered = np.sort(written)
    twice = ordered[1:] == ordered[:-1]
    if twice.any():
        page = int(ordered[1:][twice][0])
    else:
        page = next(int(p) for p in written if np.count_nonzero(listed == p) > 1)
    owners = sorted(set(request_of(indptr, np.flatnonzero(listed == page)).tolist()))
    raise PlanError(
        f"{field}: page {page} is written this step and also listed by requests {owners}; "
        "a page being written must belong to one request only"
    )


def read_pages(spec: AttentionSpec, batch, need: np.ndarray, page_limit: int, short: str,
               ahead: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pages each request reads, the first need[i] (>= 1) of its list, after checking the lists:
    page_indptr within page_indices, at least need[i] pages each (else PlanError with the counts and
    `short`; or naming where the indptr decreases), page ids below page_limit. ahead: tokens past
    kv_len the pages must hold (a draft round's later steps), named in the error. Returns (kv_indptr [B+1],
    kv_indices, every listed page), the batch's own arrays when the lists are exact."""
    indptr, idx = batch.page_indptr, batch.page_indices
    n_listed = idx.shape[0]
    if indptr[0] != 0 or indptr.min() < 0 or indptr.max() > n_listed:
        raise PlanError(f"page_indptr must start at 0 and stay within page_indices (length {n_listed}), "
                        f"got {indptr[0]}..{indptr[-1]} (min {indptr.min()}, max {indptr.max()})")
    spare = indptr[1:] - indptr[:-1]
    spare -= need
    if spare.min() < 0:
        i = int(np.flatnonzero(spare < 0)[0])
        a, b = int(indptr[i]), int(indptr[i + 1])
        if b < a:
            raise PlanError(f"page_indptr[{i + 1}]: decreases ({a} then {b}) (request {i})")
        tokens = f"kv_len {int(batch.kv_lens[i])}" + (f" + {ahead}" if ahead else "")
        raise PlanError(f"page_indptr: request {i} lists {b - a} pages (page_indptr[{i}:{i + 2}] = {a}, {b}), {short}: "
                        f"{int(need[i])} pages of {spec.page_size} tokens for {tokens} (request {i})")
    listed = idx[: indptr[-1]]
    check_page_ids(spec, "page_indices", indptr, listed, page_limit)
    if spare.max() == 0:
        return indptr, listed, listed
    return (*gather_ranges(idx, indptr[:-1], need), listed)
