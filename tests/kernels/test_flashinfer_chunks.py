"""ChunkRanges (kernels/_flashinfer_fast.py) on the CPU: its counts are FlashInfer's planners' (written
out here from scheduler.cuh, request by request), and `holds` says yes exactly when every count is
the same as at the plan."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_attn.kernels._flashinfer_fast import ChunkRanges


def flashinfer_counts(kv_lens, page_size: int, chunk_pages: int, cap) -> list[int]:
    """DecodeSplitKVIndptr / PrefillSplitQOKVIndptr's num_chunks_kv per request, kv_indptr from the lengths."""
    out = []
    for kv in kv_lens:
        pages = -(-int(kv) // page_size)
        eff = pages if cap is None else min(cap, pages)
        out.append(-(-max(eff, 1) // chunk_pages))
    return out


@st.composite
def cases(draw):
    ps = draw(st.sampled_from([1, 16, 64]))
    cp = draw(st.integers(1, 40))
    cap = draw(st.one_of(st.none(), st.integers(1, 60)))
    B = draw(st.integers(1, 12))
    planned = draw(st.lists(st.integers(1, 5000), min_size=B, max_size=B))
    step = draw(st.lists(st.integers(-200, 200), min_size=B, max_size=B))
    now = [max(1, a + d) for a, d in zip(planned, step)]
    return ps, cp, cap, np.array(planned, np.int32), np.array(now, np.int32)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_holds_exactly_when_every_chunk_count_is_the_same(case):
    ps, cp, cap, planned, now = case
    r = ChunkRanges(cp, ps, cap)
    assert r.counts(planned).tolist() == flashinfer_counts(planned, ps, cp, cap)
    assert not r.holds(planned)  # nothing planned yet
    r.plan(planned)
    assert r.holds(planned)
    same = flashinfer_counts(now, ps, cp, cap) == flashinfer_counts(planned, ps, cp, cap)
    assert r.holds(now) == same, (case, r.counts(now), r.counts(planned))
    assert not r.holds(now[:-1]) if len(now) > 1 else True  # another batch size: planned again


def test_a_step_walking_one_token_at_a_time_keeps_the_plan_until_a_count_moves():
    r = ChunkRanges(4, 16, None)  # 64-token chunks
    kv = np.array([60, 100, 130], np.int32)
    r.plan(kv)
    kept = []
    for _ in range(10):
        kv = kv + 1
        kept.append(r.holds(kv))
    # request 0 crosses 64 at its 5th step: counts move from then on
    assert kept == [True] * 4 + [False] * 6
