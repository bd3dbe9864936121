"""Shared-prefix (cascade) detection: which requests of a step read the same leading pages. Pure numpy.

Requests whose page lists start with the same run of whole pages (a system prompt, few-shot
examples, parallel samples of one prompt) can read that run once per group instead of once per
request: attention over the shared run for all the group's queries, attention over each request's
own suffix, merged by log-sum-exp (see kernels/reference.py `run_cascade`). A shared page holds
only cached tokens of every member (it ends at or before each member's first new token), so every
query of the group sees all of it (causal masks do not cut it) and no member writes it this step
(the ownership rule forbids writing a page two requests list anyway). A prefix that ends mid-page
leaves that page to each request's suffix.
"""

from __future__ import annotations

import attrs
import numpy as np

from mstar_attn.metadata._arrays import array_field, read_only
from mstar_attn.metadata.errors import PlanError

__all__ = ["Cascade", "find_prefixes"]


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
