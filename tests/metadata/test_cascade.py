"""find_prefixes: groups of requests whose page lists start with the same run of whole cached pages."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn import PlanError, StepBatch
from mstar_attn.metadata.cascade import find_prefixes


@st.composite
def families(draw):
    """Requests in prefix families (a shared run of pages, then pages of their own) and loners, shuffled."""
    ps = draw(st.sampled_from([1, 4, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(5000))
    reqs = []
    for _ in range(draw(st.integers(0, 4))):
        run = [free.pop() for _ in range(draw(st.integers(1, 6)))]
        for _ in range(draw(st.integers(1, 5))):
            own = [free.pop() for _ in range(draw(st.integers(1, 4)))]
            reqs.append(run + own)
    for _ in range(draw(st.integers(0, 4))):
        reqs.append([free.pop() for _ in range(draw(st.integers(1, 6)))])
    if not reqs:
        reqs.append([free.pop()])
    order = rng.permutation(len(reqs))
    pages = [reqs[i] for i in order]
    kv = np.array([len(p) * ps - int(rng.integers(0, ps)) for p in pages], np.int32)  # the last page may be partial
    q = np.array([int(rng.integers(1, max(2, min(int(k), 3 * ps)))) for k in kv], np.int32)
    q = np.minimum(q, kv)
    return ps, pages, q, kv, seed


@settings(max_examples=200, deadline=None)
@given(families())
def test_groups_are_exact_maximal_and_complete(case):
    ps, pages, q, kv, seed = case
    batch = StepBatch.from_pages(q, kv, pages, ps)
    c = find_prefixes(batch.page_indptr, batch.page_indices, q, kv, ps)
    full = (kv - q) // ps
    seen = set()
    for g in range(c.num_groups):
        members = c.members[c.members_indptr[g] : c.members_indptr[g + 1]]
        run = int(c.shared_pages[g])
        assert len(members) >= 2 and run >= 1, seed
        lead = [pages[i][:run] for i in members]
        assert all(x == lead[0] for x in lead), (seed, g)  # the same pages, in order
        assert all(full[i] >= run for i in members), (seed, g)  # whole pages of cached tokens only
        nxt = {pages[i][run] if full[i] > run else None for i in members}
        assert len(nxt) > 1 or None in nxt, (seed, g)  # maximal: page `run` is not shareable by all
        assert all(c.group_of[i] == g and c.suffix_page[i] == run for i in members), seed
        seen |= set(int(i) for i in members)
    cands = [i for i in range(len(pages)) if full[i] >= 1]
    for i in cands:  # complete: two requests that could share their first page are in one group
        for j in cands:
            if i < j and pages[i][0] == pages[j][0]:
                assert c.group_of[i] == c.group_of[j] >= 0, (seed, i, j)
    for i in set(range(len(pages))) - seen:
        assert c.group_of[i] == -1 and c.suffix_page[i] == 0, seed
    assert c.pages_saved() == sum((c.members_indptr[g + 1] - c.members_indptr[g] - 1) * c.shared_pages[g]
                                  for g in range(c.num_groups)), seed


def test_a_prefix_ending_mid_page_leaves_that_page_to_the_suffixes():
    """Three requests list the same 3 pages; one has cached only 2.5 of them: the group shares 2."""
    ps = 4
    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12]]
    kv, q = np.array([16, 16, 11]), np.array([1, 2, 1])  # cached: 15, 14, 10 tokens -> 3, 3, 2 whole pages
    b = StepBatch.from_pages(q, kv, pages, ps)
    c = find_prefixes(b.page_indptr, b.page_indices, q, kv, ps)
    assert c.num_groups == 1 and list(c.shared_pages) == [2] and list(c.suffix_page) == [2, 2, 2]
    longer = find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_pages=3)  # without the short one
    assert list(longer.members) == [0, 1] and list(longer.shared_pages) == [3] and list(longer.group_of) == [0, 0, -1]
    assert find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_requests=4).num_groups == 0
    with pytest.raises(PlanError, match="min_pages"):
        find_prefixes(b.page_indptr, b.page_indices, q, kv, ps, min_pages=0)
