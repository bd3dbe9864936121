"""Random StepBatch decode steps with exact page lists, valid or broken in a named way (`decode_batch`), and own
lists for a spec's own-list groups (`own_lists`): the cases build_plan's per-step path is held to the general one on."""

import numpy as np

from mstar_attn import CrossRows, GroupPages, StepBatch
from tests.helpers import random_pages


def own_lists(rng, spec, kv: np.ndarray, kind: str) -> dict:
    """Own lists (from a random first page up to the window's first read page) for the spec's own-list groups, broken
    (or not) by `kind`: own_short (a request's list a page short), own_first (a list starting past the first page the
    window reads), own_outside (a page id past the cache), own_written (another request lists a written page),
    own_spare (a page past what the step reads: valid)."""
    from mstar_attn.metadata.groups import first_read_page

    ps, B, out = spec.page_size, kv.shape[0], {}
    for g in spec.own_page_groups:
        start = first_read_page(spec.groups[g], np.ones(B, np.int32), kv, ps)
        first = (rng.integers(0, 2, B) * start).astype(np.int32)  # from page 0, or trimmed to the window
        need = -(-kv // ps)
        ids = rng.permutation(spec.num_pages).astype(np.int32)
        lists, at = [], 0
        for f, n in zip(first, need):
            lists.append(ids[at : at + n - f].copy())
            at += n - f
        i = int(rng.integers(B))
        if kind == "own_short" and len(lists[i]):
            lists[i] = lists[i][:-1]
        elif kind == "own_first":
            first[i] = start[i] + 1
        elif kind == "own_outside" and len(lists[i]):
            lists[i][int(rng.integers(len(lists[i])))] = spec.num_pages
        elif kind == "own_spare":  # a page past what the step reads (the gather, from the first page on)
            lists[i] = np.concatenate([lists[i], ids[-1:]])
        elif kind == "own_written" and B > 1 and len(lists[i]):
            j = (i + 1) % B
            if len(lists[j]):
                lists[j][int(rng.integers(len(lists[j])))] = lists[i][-1]
        out[g] = GroupPages.from_pages(first, lists)
    for g, group in enumerate(spec.groups):  # cross groups: encoder pages listed, or cross-table rows
        if not group.cross:
            continue
        enc = rng.integers(1, 5 * ps, B).astype(np.int32)
        write = rng.integers(0, 2, B).astype(bool) if rng.integers(2) else np.zeros(B, bool)  # (half: a step storing none)
        i = int(rng.integers(B))
        if kind == "cross_empty":
            enc[i] = 0
        if rng.integers(2):
            rows = rng.permutation(4 * B).astype(np.int32)[:B]
            if kind == "cross_row":
                rows[i] = -1
            out[g] = CrossRows.of(rows, enc, write)
        else:
            lists = random_pages(rng, enc, ps, spec.num_pages)
            if kind == "cross_row" and len(lists[i]):  # (listed pages: one page short instead)
                lists[i] = lists[i][:-1]
            out[g] = GroupPages.cross(lists, enc, write)
    return out


def decode_batch(rng, spec, B: int, kind: str) -> StepBatch:
    """A decode batch of B requests over spec's pages with exact lists, then broken (or not) by `kind`; the spec's
    own-list groups get their lists (own_lists; none with kind own_missing)."""
    ps = spec.page_size
    kv = rng.integers(1, 6 * ps, B).astype(np.int32)
    pages = random_pages(rng, kv, ps, spec.num_pages, extra=1 if kind == "spare" else 0)
    own = own_lists(rng, spec, kv, kind) if kind != "own_missing" else None
    i = int(rng.integers(B))
    q = np.ones(B, np.int32)
    if kind == "q2":
        q[i], kv[i] = 2, max(kv[i], 2)
    elif kind == "kv0":
        kv[i] = 0
        if rng.integers(2):
            pages[i] = pages[i][:0]  # (and no pages: the list then matches its zero need)
    elif kind == "outside":
        pages[i][int(rng.integers(len(pages[i])))] = rng.choice([-1, spec.num_pages, spec.num_pages + 1, 2**30])
    elif kind == "short":
        kv[i] += ps  # one page more than it lists
    elif kind == "shared_written" and B > 1:
        j = (i + 1) % B
        pages[j][int(rng.integers(len(pages[j])))] = pages[i][-1]  # another request lists i's written page
    elif kind == "past_int32":
        kv[i] = 2**31 - 2
    elif kind == "wrapped":  # an engine's int32 cumsum of lengths past int32: its indptr wraps, yet its diffs match
        kv[:] = 2**31 - 2 * ps
        need = -(-kv.astype(np.int64) // ps)
        indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int64).astype(np.int32)  # (wraps)
        return StepBatch.from_csr(q, kv, indptr, np.arange(4, dtype=np.int32) % spec.num_pages, ps)
    elif kind == "block_table":
        table = np.full((B, max(len(p) for p in pages)), 0, np.int32)
        for r, p in enumerate(pages):
            table[r, : len(p)] = p
        return StepBatch.from_block_table(q, kv, table, ps)
    elif kind == "own_list":  # an own list for a group that reads the shared one: PlanError
        lists = GroupPages.from_pages(np.zeros(B, np.int32), pages)
        return StepBatch.from_pages(q, kv, pages, ps, group_pages={0: lists, **(own or {})})
    elif kind == "csr_extra":  # page_indices longer than page_indptr[-1], or page_indptr not starting at 0
        indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
        flat = np.concatenate(pages + [np.array([int(pages[0][0])], np.int32)])
        return StepBatch.from_csr(q, kv, indptr + int(rng.integers(2)), flat, ps, own)
    return StepBatch.from_pages(q, kv, pages, ps, own)
