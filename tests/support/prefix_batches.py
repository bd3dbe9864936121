"""Random batches of requests in shared-prefix families, for the cascade tests (CPU and GPU)."""

from __future__ import annotations

import numpy as np


def prefix_batch(rng: np.random.Generator, page_size: int, q_len: int, num_pages: int,
                 families=(3, 2, 4), loners: int = 2, max_prefix_pages: int = 6, max_own_pages: int = 4):
    """(q_lens, kv_lens, pages) of a decode (q_len 1) or verify step, shuffled: each family shares a
    prefix of random length in tokens, whose whole pages every member lists by the same ids; a
    prefix ending mid-page leaves that page to each member as a page of its own (an engine copies it
    on write), so it belongs to the suffix. Loners share nothing. Every request has at least one
    token after its prefix, and its new tokens lie on its own pages."""
    ps = page_size
    free = list(rng.permutation(num_pages))
    pages, kv = [], []
    for members in families:
        prefix = int(rng.integers(ps, max_prefix_pages * ps + 1))
        run = [free.pop() for _ in range(prefix // ps)]
        for _ in range(members):
            total = prefix + int(rng.integers(q_len, max_own_pages * ps + 1))
            own = -(-total // ps) - len(run)
            pages.append(run + [free.pop() for _ in range(own)])
            kv.append(total)
    for _ in range(loners):
        total = int(rng.integers(q_len + 1, (max_prefix_pages + max_own_pages) * ps + 1))  # (a cached token: a verify step)
        pages.append([free.pop() for _ in range(-(-total // ps))])
        kv.append(total)
    order = rng.permutation(len(pages))
    kv = np.array(kv, np.int32)[order]
    return np.full(len(pages), q_len, np.int32), kv, [pages[i] for i in order]
