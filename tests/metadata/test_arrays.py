"""metadata/_arrays.py: the per-request range check both of its branches (Python lists up to SHORT_CHECK requests,
numpy past) against its definition in int64, on seeded random ranges and values; the per-step path's one copy of
int32 vectors (packed_int32)."""

import numpy as np
import pytest

from mstar_attn.metadata._arrays import SHORT_CHECK, Ranges, packed_int32
from tests.helpers import fresh_seed


@pytest.mark.parametrize("B", [1, 2, SHORT_CHECK - 1, SHORT_CHECK, SHORT_CHECK + 1, 3 * SHORT_CHECK])
def test_ranges_hold_exactly_when_every_value_is_in_its_range(B):
    seed = 1000 + B
    rng = np.random.default_rng(seed)
    held = 0
    for trial in range(400):
        low = rng.integers(1, 200, B).astype(np.int32)
        span = rng.integers(0, 40, B).astype(np.uint32)
        if trial % 5 == 0:  # an unbounded range (a capped chunk count): up to int32's largest value
            span[rng.integers(0, B)] = 2**31 - int(low.max())
        # values near the bounds: each request's value in its range unless nudged out
        values = low.astype(np.int64) + (rng.integers(0, 2**20, B) % np.maximum(span, 1))
        out = rng.random(B) < (0.5 / B if trial % 2 else 0)
        values[out] += np.where(rng.random(out.sum()) < 0.5, -int(rng.integers(1, 3)), span[out].astype(np.int64))
        values = np.clip(values, -(2**31), 2**31 - 1).astype(np.int32)
        want = bool(np.all((values >= low) & (values.astype(np.int64) < low.astype(np.int64) + span)))
        got = Ranges(low, span).holds(values)
        assert got == want, f"seed {seed} trial {trial}: low {low} span {span} values {values}"
        held += got
    assert 0 < held < 400, f"seed {seed}: the trials did not exercise both answers"


def test_ranges_refuse_another_number_of_values():
    r = Ranges(np.array([1, 5], np.int32), np.array([10, 10], np.uint32))
    assert r.holds(np.array([3, 6], np.int32))
    assert not r.holds(np.array([3], np.int32)) and not r.holds(np.array([3, 6, 7], np.int32))


def test_packed_int32_is_one_read_only_copy_of_native_int32_vectors():
    """packed_int32: native int32 vectors back to back in one read-only copy (later writes to the inputs do not
    reach it); None for anything else (another dtype or byte order, a list, another rank), which int_array checks."""
    rng = np.random.default_rng(seed := fresh_seed())
    for _ in range(50):
        arrays = tuple(rng.integers(-2**31, 2**31 - 1, int(rng.integers(0, 9))).astype(np.int32) for _ in range(int(rng.integers(1, 5))))
        packed = packed_int32(arrays)
        want = np.concatenate(arrays)
        assert packed.dtype == np.int32 and not packed.flags.writeable and np.array_equal(packed, want), seed
        for a in arrays:
            a += 1
        assert np.array_equal(packed, want), seed
    a = np.arange(4, dtype=np.int32)
    for other in (a.astype(np.int64), a.tolist(), a.reshape(2, 2), a.astype(">i4"), a.astype(np.uint32)):
        assert packed_int32((a, other)) is None and packed_int32((other,)) is None, type(other)


@pytest.mark.parametrize("B", [0, 1, 3, SHORT_CHECK, 3 * SHORT_CHECK])
def test_holds_from_one_is_holds_for_values_from_one(B, monkeypatch):
    """Ranges.holds_from_one(values, max(values)) answers as holds(values) for values each at least 1 (what a sealed
    plan's lengths are), on random ranges (some starting at 1, some below or above it, some empty, some spans past
    2**31) and values of the same and of another count, without asking holds exactly where the values are as many as
    the ranges and the longest is within all_hold_up_to(); that is the largest h with every range holding 1..h (0 for
    none), by its definition."""
    rng = np.random.default_rng(seed := fresh_seed())
    asked, holds = [], Ranges.holds
    monkeypatch.setattr(Ranges, "holds", lambda self, values: asked.append(1) or holds(self, values))
    fast = 0
    for _ in range(300):
        above = rng.random() * (rng.random() < 0.5)  # (half the trials every range starts at 1 or below; else some above)
        low = np.where(rng.random(B) < above, rng.integers(2, 50, B), rng.integers(-3, 2, B)).astype(np.int32)
        span = np.where(rng.random(B) < 0.1, rng.integers(2**31 - 5, 2**32, B), rng.integers(0, 200, B)).astype(np.uint32)
        r = Ranges(low, span)
        ends = [lo + n for lo, n in zip(low.tolist(), span.tolist())]
        top = r.all_hold_up_to()  # (every range holds 1..top, and not 1..top + 1; 0 for no requests)
        every = lambda h: all(lo <= 1 and end > h for lo, end in zip(low.tolist(), ends))  # noqa: E731
        assert (top == 0 or every(top)) and (not every(top + 1) if B else top == 0), (seed, low.tolist(), span.tolist(), top)
        for n in (B, B + 1) if B else (0, 1):
            values = rng.integers(1, 260, n).astype(np.int32)
            if rng.random() < 0.5 and n:  # (often within every range's 1..h: the fast answer)
                values = rng.integers(1, min(max(top, 1), 2**31 - 1) + 1, n).astype(np.int32)
            longest = int(values.max()) if n else 1
            want, quick = holds(r, values), longest <= top and n == B
            del asked[:]
            assert r.holds_from_one(values, longest) == want, (seed, low.tolist(), span.tolist(), values.tolist())
            assert bool(asked) != quick and (want or not quick), (seed, quick, asked)
            fast += quick
    assert B == 0 or fast, seed  # (the fast answer was taken)
