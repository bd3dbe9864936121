"""Shared-prefix (cascade) detection: which requests of a step read the same leading pages. Pure numpy.

Requests whose page lists start with the same run of whole pages (a system prompt, few-shot
examples, parallel samples of one prompt) can read that run once per group instead of once per
request: attention over the shared run for all the group's queries, attention over each request's
own suffix, merged by log-sum-exp (kernels/reference.py `_attend_cascade`, kernels/_cascade.py). A shared page holds
only cached tokens of every member (it ends at or before each member's first new token), so every
query of the group sees all of it (causal masks do not cut it) and no member writes it this step
(the ownership rule forbids writing a page two requests list anyway). A prefix that ends mid-page
leaves that page to each request's suffix.
"""

from __future__ import annotations

import warnings

import attrs
import numpy as np

from mstar_attn.metadata._arrays import array_field, read_only
from mstar_attn.metadata.batch import bucket_of
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.pages import gather_ranges

__all__ = ["Cascade", "CascadePlan", "CostModel", "find_prefixes", "level_plan"]


@attrs.frozen
class Cascade:
    """The prefix groups of one step over B requests, int32 host arrays (G groups).

    members_indptr [G+1], members [m]: group g's requests, members[members_indptr[g]:members_indptr[g+1]]
    shared_pages [G]: the whole pages group g shares (its run: the first shared_pages[g] pages of any member)
    group_of [B]: each request's group, or -1 (it reads its whole list alone)
    suffix_page [B]: the first logical page of each request's own part (0 for requests in no group)
    """

    members_indptr: np.ndarray = array_field()
    members: np.ndarray = array_field()
    shared_pages: np.ndarray = array_field()
    group_of: np.ndarray = array_field()
    suffix_page: np.ndarray = array_field()

    @property
    def num_groups(self) -> int:
        return self.shared_pages.shape[0]

    def pages_saved(self) -> int:
        """Page reads the groups save per layer: each shared run read once instead of once per member."""
        sizes = np.diff(self.members_indptr)
        return int(((sizes - 1) * self.shared_pages).sum())


def find_prefixes(kv_indptr: np.ndarray, kv_indices: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                  page_size: int, min_pages: int = 1, min_requests: int = 2) -> Cascade:
    """Group the requests whose page lists (CSR kv_indptr [B+1], kv_indices) start with the same page
    and keep the longest run of whole pages all members of a group list alike and hold only cached
    tokens of (page j is shareable by request i when (j + 1) * page_size <= kv_lens[i] - q_lens[i]).
    Groups need min_requests members and a run of min_pages pages. O(B log B + shared pages)."""
    if min_pages < 1 or min_requests < 2:
        raise PlanError(f"find_prefixes: min_pages >= 1 and min_requests >= 2, got {min_pages}, {min_requests}")
    B = q_lens.shape[0]
    full = ((kv_lens - q_lens) // page_size).astype(np.int64)  # whole cached pages of each request
    full = np.minimum(full, kv_indptr[1:] - kv_indptr[:-1])
    cand = np.flatnonzero(full >= min_pages)
    first = kv_indices[kv_indptr[:-1][cand]]
    order = cand[np.argsort(first, kind="stable")]
    first = kv_indices[kv_indptr[:-1][order]]
    bounds = np.flatnonzero(np.diff(first)) + 1
    groups, runs = [], []
    for members in np.split(order, bounds):
        if members.shape[0] < min_requests:
            continue
        width = int(full[members].min())
        starts = kv_indptr[:-1][members]
        pages = kv_indices[starts[:, None] + np.arange(width)]  # [m, width]: each member's leading pages
        same = (pages == pages[:1]).all(axis=0)
        run = width if same.all() else int(np.argmin(same))
        if run >= min_pages:
            groups.append(np.sort(members))
            runs.append(run)
    sizes = np.array([g.shape[0] for g in groups], np.int32)
    members_indptr = np.zeros(len(groups) + 1, np.int32)
    np.cumsum(sizes, out=members_indptr[1:])
    members = np.concatenate(groups).astype(np.int32) if groups else np.zeros(0, np.int32)
    shared = np.array(runs, np.int32)
    group_of = np.full(B, -1, np.int32)
    group_of[members] = np.repeat(np.arange(len(groups), dtype=np.int32), sizes)
    suffix_page = np.zeros(B, np.int32)
    suffix_page[members] = np.repeat(shared, sizes)
    read_only(members_indptr, members, shared, group_of, suffix_page)
    return Cascade(members_indptr, members, shared, group_of, suffix_page)


@attrs.frozen
class CascadePlan:
    """A step's two attention levels over its shared page list, int32 host arrays in *level order*:
    the requests of group 0, of group 1, ..., then the requests in no group (in batch order).

    prefixes: the Cascade they come from (G groups, B requests)
    order [B]: the requests in level order;  query_order [T]: the query rows in level order (a permutation of 0..T-1)
    member_queries (property): the first member_queries entries of `query_order` are the groups' (the shared level's queries)
    shared_qo_indptr [G+1]: group g's queries are level rows shared_qo_indptr[g]:shared_qo_indptr[g+1]
    shared_kv_indptr [G+1], shared_kv_indices: group g's shared run (whole pages: every key of it seen)
    suffix_qo_indptr [B+1]: level request j's queries;  suffix_kv_indptr [B+1], suffix_kv_indices: its own pages
    suffix_last_page_len [B], suffix_kv_lens [B]: its suffix's tokens on the last page, and in all (>= q_len)
    """

    prefixes: Cascade = attrs.field(repr=False)
    order: np.ndarray = array_field()
    query_order: np.ndarray = array_field()
    shared_qo_indptr: np.ndarray = array_field()
    shared_kv_indptr: np.ndarray = array_field()
    shared_kv_indices: np.ndarray = array_field()
    suffix_qo_indptr: np.ndarray = array_field()
    suffix_kv_indptr: np.ndarray = array_field()
    suffix_kv_indices: np.ndarray = array_field()
    suffix_last_page_len: np.ndarray = array_field()
    suffix_kv_lens: np.ndarray = array_field()

    @property
    def num_groups(self) -> int:
        return self.prefixes.num_groups

    @property
    def member_queries(self) -> int:
        return int(self.shared_qo_indptr[-1])

    @property
    def rows(self) -> np.ndarray:
        """Deprecated: query_order."""
        warnings.warn("CascadePlan.rows is deprecated: use query_order", DeprecationWarning, 2)
        return self.query_order

    @property
    def member_rows(self) -> int:
        """Deprecated: member_queries."""
        warnings.warn("CascadePlan.member_rows is deprecated: use member_queries", DeprecationWarning, 2)
        return self.member_queries


def level_plan(c: Cascade, qo_indptr: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray, kv_indptr: np.ndarray,
               kv_indices: np.ndarray, last_page_len: np.ndarray, page_size: int) -> CascadePlan:
    """The level arrays of Cascade `c` over a plan's shared list (int32 host arrays: qo_indptr [B+1],
    q_lens, kv_lens [B], kv_indptr [B+1], kv_indices, last_page_len [B]). O(B + T + pages)."""
    alone = np.flatnonzero(c.group_of < 0).astype(np.int32)
    order = np.concatenate([c.members, alone]).astype(np.int32)
    q = q_lens[order]
    level_qo = np.zeros(order.shape[0] + 1, np.int32)
    np.cumsum(q, out=level_qo[1:])
    rows = np.repeat(qo_indptr[:-1][order] - level_qo[:-1], q).astype(np.int32)
    rows += np.arange(level_qo[-1], dtype=np.int32)
    shared_qo = level_qo[c.members_indptr]
    first_member = c.members[c.members_indptr[:-1]]
    shared_indptr, shared_idx = gather_ranges(kv_indices, kv_indptr[:-1][first_member], c.shared_pages)
    skip = c.suffix_page[order]
    own = (kv_indptr[1:] - kv_indptr[:-1])[order] - skip
    suffix_indptr, suffix_idx = gather_ranges(kv_indices, kv_indptr[:-1][order] + skip, own)
    suffix_lens = (kv_lens[order] - skip * page_size).astype(np.int32)
    lpl = last_page_len[order]
    read_only(order, rows, shared_qo, level_qo, suffix_lens, lpl)
    return CascadePlan(prefixes=c, order=order, query_order=rows, shared_qo_indptr=shared_qo,
                       shared_kv_indptr=shared_indptr, shared_kv_indices=shared_idx, suffix_qo_indptr=level_qo,
                       suffix_kv_indptr=suffix_indptr, suffix_kv_indices=suffix_idx, suffix_last_page_len=lpl,
                       suffix_kv_lens=suffix_lens)


@attrs.frozen
class CostModel:
    """Estimated GPU time (µs) of one layer's attention, flat paged vs cascade, for a decode step.

    flat:    a_flat + the larger of (unique KV bytes / hbm, w x the shared runs' re-reads / l2) + ov x
             the smaller (a group's members read the same pages at about the same time, so repeats
             mostly hit L2). w, ov from FlashInfer's decode grid (`partition`): its planner gives each
             request n KV chunks. The re-reads from L2 are bound by each CTA's stream rate (about
             37-40 GB/s on the H100, notes/library_apis.md §11), so w, the wave quantization of the
             CTAs (a padded bucket or a last partial wave takes as long as a full one), scales that
             term; the unique bytes are bound by HBM and do not scale. ov is `overlap` when n = 1 and
             `ov_split` when the KV is split (the unique and repeated reads then stream side by side).
             Fitted at 8 KV heads, GQA 4 and 8, page 16, head_dim 128 (FlashInfer's tensor-core
             decode); other shapes extrapolate.
    cascade: a_cascade + each group's shared level, the larger of its tensor-core arithmetic
             (4 x rows x q_heads x run tokens x head_dim, rows padded to 64-row tiles per KV head)
             over `flops` and its run's bytes over hbm_levels, + `row` per query row and head of the
             groups (the partial outputs and LSEs written, merged), + the suffixes' bytes over
             hbm_levels. (The levels run on two streams, but the shared level's split-KV grid fills
             the GPU: they add up.)
    Rates in bytes (or flops) per µs. Fitted on the H100 over the crossover grid of
    benchmarks/cascade_grid.py by benchmarks/cascade_fit.py (a coarse search over round values:
    fewest grid shapes where the pick is > 3% slower than the faster path, then the least log
    error); benchmarks/results/cascade_h100.md lists every shape, both times and the pick, and
    cascade_heldout_h100.md the same on shapes off the grid (held out of the fit). Decode only:
    verify steps were not measured, so "auto" leaves them flat. A model of one GPU: refit it for another.
    """

    a_flat: float = 15.0
    a_cascade: float = 30.0
    hbm: float = 3.2e6  # the flat kernel's unique bytes
    l2: float = 1.0e7  # the flat kernel's repeated reads of shared pages
    overlap: float = 1.0  # the part of the shorter of those two terms that does not overlap the longer
    ov_split: float = 0.5  # the same when FlashInfer splits every request's KV (small batches)
    slots: int = 264  # the CTAs FlashInfer's planner sizes its grid for: 2 per SM, 132 SMs
    hbm_levels: float = 3.2e6  # the cascade levels' bytes
    flops: float = 3.0e8
    row: float = 0.004  # µs per member query row x query head
    margin: float = 0.03  # cascade only when it is estimated this much faster

    def partition(self, batch_size: int, kv_heads: int, pages: int, page_size: int) -> tuple[int, float]:
        """FlashInfer's flat decode grid for a step of B requests whose longest reads `pages` pages:
        (n, w). Its planner (in graph mode over the step padded to the pool's default bucket,
        DEFAULT_BUCKETS; eager past the largest) cuts each request's KV into the most chunks that fit
        slots / kv_heads CTAs per KV head beside the padding requests (room: r per request), in
        chunks of at least m = 128 / page_size pages: chunk = max(m, ceil(pages / r)), n = ceil(pages
        / chunk) (exact for lists of one length, the longest's otherwise; tests/metadata/test_cascade.py
        writes FlashInfer's search out). Its B x n x kv_heads CTAs run in waves of `slots`: w = waves x
        slots / (kv_heads x n) / B, the requests one full wave would hold over those there are."""
        padded = bucket_of(batch_size) or batch_size  # eager past the largest bucket: unpadded
        room = (self.slots // kv_heads - (padded - batch_size)) // batch_size
        chunk = max(max(128 // page_size, 1), -(-pages // room)) if room >= 1 else pages
        n = -(-pages // max(chunk, 1))
        waves = -(-(batch_size * n * kv_heads) // self.slots)
        return n, waves * self.slots / (kv_heads * n * batch_size)

    def times(self, c: Cascade, q_lens: np.ndarray, kv_lens: np.ndarray, page_size: int, q_heads: int,
              kv_heads: int, head_dim: int, kv_bytes: int) -> tuple[float, float]:
        """(flat µs, cascade µs) of a step of B requests: q_lens, kv_lens [B] int32 host arrays, c its
        Cascade; kv_bytes: bytes of one cached token's K and V (all KV heads)."""
        sizes = np.diff(c.members_indptr).astype(np.int64)
        run_tokens = c.shared_pages.astype(np.int64) * page_size
        total = int(kv_lens.sum(dtype=np.int64))
        repeats = int(((sizes - 1) * run_tokens).sum())
        n, w = self.partition(len(kv_lens), kv_heads, -(-int(kv_lens.max()) // page_size), page_size)
        unique, again = (total - repeats) * kv_bytes / self.hbm, w * repeats * kv_bytes / self.l2
        ov = self.ov_split if n > 1 else self.overlap
        flat = self.a_flat + max(unique, again) + ov * min(unique, again)
        member_q = np.add.reduceat(q_lens[c.members].astype(np.int64), c.members_indptr[:-1]) if sizes.size else sizes
        tiles = -(-(member_q * (q_heads // kv_heads)) // 64) * 64  # a group's query rows of one KV head
        shared = np.maximum(4 * kv_heads * tiles * run_tokens * head_dim / self.flops, run_tokens * kv_bytes / self.hbm_levels)
        suffix = (total - int((sizes * run_tokens).sum())) * kv_bytes / self.hbm_levels
        rows = int(member_q.sum()) * q_heads * self.row
        return flat, self.a_cascade + float(shared.sum()) + rows + suffix

    def wins(self, *args) -> bool:
        flat, cascade = self.times(*args)
        return cascade < flat * (1 - self.margin)


COST = CostModel()


def plan_cascade(spec, q_lens: np.ndarray, kv_lens: np.ndarray, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                 kv_indices: np.ndarray, last_page_len: np.ndarray, always: bool = False) -> CascadePlan | None:
    """The cascade of one decode / verify step over its shared list (the plan's int32 host arrays:
    q_lens, kv_lens, last_page_len [B], qo_indptr, kv_indptr [B+1], kv_indices), or None: no group
    of requests shares a run of whole cached pages, or (spec.cascade "auto", not `always`) the step
    is not a decode step or the cost model estimates the flat path no slower. Pure; O(B log B + pages)."""
    ps = spec.page_size
    if not always and spec.cascade != "always" and q_lens.max() > 1:
        return None  # "auto": the model is measured on decode steps only
    c = find_prefixes(kv_indptr, kv_indices, q_lens, kv_lens, ps)
    if not c.num_groups:
        return None
    if not always and spec.cascade != "always":
        kv_bytes = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        if not COST.wins(c, q_lens, kv_lens, ps, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, kv_bytes):
            return None
    return level_plan(c, qo_indptr, q_lens, kv_lens, kv_indptr, kv_indices, last_page_len, ps)
