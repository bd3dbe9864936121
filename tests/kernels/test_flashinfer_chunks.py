"""ChunkRanges (kernels/_flashinfer_fast.py) on the CPU: its counts are FlashInfer's planners' (written
out here from scheduler.cuh, request by request), and `holds` says yes exactly when every count over the
plan's rows (padding requests included) is the same as at the plan."""

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


def lanes(kv_lens, rows: int, pad_len: int) -> list[int]:
    """The KV lengths of a plan's `rows` requests: the step's, then padding requests of pad_len tokens."""
    return [int(k) for k in kv_lens] + [pad_len] * (rows - len(kv_lens))


@st.composite
def cases(draw):
    ps = draw(st.sampled_from([1, 4, 16, 64]))
    cp = draw(st.integers(1, 40))
    cap = draw(st.one_of(st.none(), st.integers(1, 60)))
    rows = draw(st.integers(1, 12))
    pad_len = draw(st.integers(1, 8))  # (a step's q_len)
    B = draw(st.integers(1, rows))
    short = draw(st.booleans())  # (short lengths: most counts 1, as a padding request's)
    planned = draw(st.lists(st.integers(1, 300 if short else 5000), min_size=B, max_size=B))
    B2 = draw(st.integers(1, rows))  # (requests left or joined)
    base = draw(st.permutations(planned + draw(st.lists(st.integers(1, 300 if short else 5000), min_size=rows,
                                                        max_size=rows))[: max(B2 - B, 0)]))[:B2]
    step = draw(st.lists(st.integers(-200, 200), min_size=B2, max_size=B2))
    now = [max(1, a + d) for a, d in zip(base, step)]
    return ps, cp, cap, rows, pad_len, np.array(planned, np.int32), np.array(now, np.int32)


@settings(max_examples=600, deadline=None)
@given(cases())
def test_holds_exactly_when_every_chunk_count_is_the_same(case):
    """Over the plan's rows, padding requests included: the step's requests in any order and any number of them
    (up to the rows), each count the same as at the plan, the rest a padding request's."""
    ps, cp, cap, rows, pad_len, planned, now = case
    r = ChunkRanges(cp, ps, cap, rows, pad_len)
    assert r.counts(planned).tolist() == flashinfer_counts(planned, ps, cp, cap)
    assert not r.holds(planned) and r.over(len(planned)) is None  # nothing planned yet
    r.plan(planned)
    assert r.holds(planned)
    want = flashinfer_counts(lanes(now, rows, pad_len), ps, cp, cap) == \
        flashinfer_counts(lanes(planned, rows, pad_len), ps, cp, cap)
    assert r.holds(now) == want, (case, r.counts(now), r.counts(planned))
    ranges = r.over(len(now))
    assert (ranges is not None and ranges.holds(now)) == want, case  # (what the steady commit checks)


def test_more_requests_than_the_plan_has_rows_never_hold():
    r = ChunkRanges(4, 16, None, 3, 1)
    r.plan(np.array([5, 6], np.int32))
    assert r.holds(np.array([5, 6, 1], np.int32)) and not r.holds(np.array([5, 6, 1, 1], np.int32))
    assert r.over(4) is None and r.over(0) is None


def test_a_step_walking_one_token_at_a_time_keeps_the_plan_until_a_count_moves():
    r = ChunkRanges(4, 16, None, 3, 1)  # 64-token chunks
    kv = np.array([60, 100, 130], np.int32)
    r.plan(kv)
    kept = []
    for _ in range(10):
        kv = kv + 1
        kept.append(r.holds(kv))
    # request 0 crosses 64 at its 5th step: counts move from then on
    assert kept == [True] * 4 + [False] * 6


def _aligned_end(allocs) -> int:
    """FlashInfer's AlignedAllocator over (bytes, alignment) allocations from an aligned base: the bytes it spans."""
    end = 0
    for size, align in allocs:
        end = -(-end // align) * align + size
    return end


def decode_plan_bytes(rows: int, kv_heads: int, blocks_per_sm: int, sms: int) -> int:
    """DecodePlan's int workspace under CUDA graphs (scheduler.cuh, written out): split-KV iff the batch leaves the
    grid idle (rows x gdy < blocks per SM x SMs, gdy = KV heads: graphs keep the split then), padded batch the grid
    per KV head if split, else the batch; three int32 lists, o_indptr, the chunk size word, the mask if split."""
    grid = blocks_per_sm * sms
    split = rows * kv_heads < grid
    P = grid // kv_heads if split else rows
    return _aligned_end([(4 * P, 16), (4 * P, 16), (4 * (P + 1), 16), (4, 1)] + ([(P, 16)] if split else []))


def prefill_plan_bytes(rows: int, q_len: int, gqa: int, kv_heads: int, sms: int, cta_tile_q: int, uniform: bool,
                       split: bool) -> int:
    """PrefillPlan's int workspace under CUDA graphs (scheduler.cuh, written out): padded batch max(2 x SMs / KV heads,
    the query tiles); three int32 lists, o_indptr [rows + 1], the chunk size word, total_num_rows, merge_indptr
    [rows x q_len + 1] if split, the mask."""
    total_rows = rows * q_len
    tiles = rows * -(-(q_len * gqa) // cta_tile_q) if uniform else -(-(total_rows * gqa) // cta_tile_q) + rows - 1
    P = max(2 * sms // kv_heads, tiles)
    allocs = [(4 * P, 16), (4 * P, 16), (4 * P, 16), (4 * (rows + 1), 16), (4, 1), (4, 16)]
    return _aligned_end(allocs + ([(4 * (total_rows + 1), 16)] if split else []) + [(P, 16)])


def test_graph_workspaces_hold_what_flashinfers_planners_allocate():
    """graph_workspace_bytes against FlashInfer's planners' int allocations (written out above from scheduler.cuh)
    over rows 1..512, q_len 1..16, GQA 1..16, 1..64 KV heads, 16..200 SMs, 1..32 blocks per SM, every query tile
    size, split or not: never short (and so FlashInfer's planner never refuses a graph wrapper's plan); with
    split=False, never short of the unsplit prefill planner's (the tree part's ragged wrapper)."""
    from mstar_attn.kernels._flashinfer_fast import graph_workspace_bytes

    worst = 0.0
    for rows in (1, 2, 3, 8, 33, 64, 128, 256, 512):
        for q_len in (1, 2, 4, 7, 16):
            for gqa in (1, 2, 4, 8, 16):
                for kv_heads in (1, 2, 8, 64):
                    for sms in (16, 132, 200):
                        have = graph_workspace_bytes(rows, q_len, gqa, kv_heads, sms)
                        need = max([decode_plan_bytes(rows, kv_heads, b, sms) for b in (1, 2, 8, 32)] if q_len == 1 else [0])
                        need = max(need, *(prefill_plan_bytes(rows, q_len, gqa, kv_heads, sms, t, u, s)
                                           for t in (16, 64, 128) for u in (False, True) for s in (False, True)))
                        assert need <= have, (rows, q_len, gqa, kv_heads, sms, need, have)
                        worst = max(worst, need / have)
                        unsplit = max(prefill_plan_bytes(rows, q_len, gqa, kv_heads, sms, t, u, False)
                                      for t in (16, 64, 128) for u in (False, True))  # (disable_split_kv: the tree part)
                        assert unsplit <= graph_workspace_bytes(rows, q_len, gqa, kv_heads, sms, split=False), \
                            (rows, q_len, gqa, kv_heads, sms, unsplit)
    assert worst > 0.25, worst  # (the bound is not vacuously loose: some shape needs a good part of it)


def test_the_padding_requests_counted_are_the_ones_the_pool_stages():
    """ChunkRanges counts a bucket's padding requests as KV length q_len (FastDecodePlan's pad_len): every group of a
    bucketed step, as the pool stages it (tests/support/staged.py: what stage_pages writes, and what the device
    derivation is held equal to in tests/capture/test_derive.py), gives each padding request q_len tokens on
    ceil(q_len / page_size) pages, for decode and verify steps, window groups included."""
    from mstar_attn import LayerGroup, StepBatch, build_plan
    from tests.helpers import fresh_seed, pool_of, spec_for
    from tests.support.staged import staged_arrays

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for ps in (1, 4, 16):
        spec = spec_for(page_size=ps, num_pages=4000, groups=(LayerGroup(), LayerGroup("window", window=7)))
        pool = pool_of(spec, max_batch_size=16, max_num_tokens=128, max_num_pages=spec.num_pages, device="cpu",
                       buckets=(8,))
        for q_len in (1, 2, 4):
            B = int(rng.integers(1, 8))
            kv = rng.integers(q_len, 300, B).astype(np.int32)
            free = iter(rng.permutation(4000).tolist())
            lists = [[next(free) for _ in range(-(-int(k) // ps))] for k in kv]
            plan = build_plan(StepBatch.from_pages(np.full(B, q_len, np.int32), kv, lists, ps), spec)
            r = ChunkRanges(1, ps, None, 8, q_len)
            for indptr, last, lens, _ in staged_arrays(pool, plan, 8, q_len)["groups"]:
                label = (f"seed {seed}", ps, q_len, B)
                assert lens[B:].tolist() == [q_len] * (8 - B), label
                assert np.diff(indptr)[B:].tolist() == [-(-q_len // ps)] * (8 - B), label
                assert r.counts(lens[B:]).tolist() == [r.pad_count] * (8 - B), label
