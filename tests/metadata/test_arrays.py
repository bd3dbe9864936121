"""metadata/_arrays.py: the per-request range check both of its branches (Python lists up to SHORT_CHECK requests,
numpy past) against its definition in int64, on seeded random ranges and values."""

import numpy as np
import pytest

from mstar_attn.metadata._arrays import SHORT_CHECK, Ranges


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
