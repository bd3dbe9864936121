"""metadata/batch.py: StepRows.decode and StepBatch.from_csr (the per-step constructors) make the step the
constructor makes of the same arrays, whatever form they come in, and hold read-only copies; what the constructor
refuses they refuse with the same message."""

import numpy as np
import pytest

from mstar_attn import PlanError
from mstar_attn.metadata.batch import StepBatch, StepRows
from tests.helpers import fresh_seed

FORMS = {  # the forms an engine may hand over: int32 (the per-step case, copied at once), int64, lists, views
    "int32": lambda a: a.astype(np.int32),
    "int64": lambda a: a.astype(np.int64),
    "list": lambda a: a.tolist(),
    "strided int32": lambda a: np.repeat(a.astype(np.int32), 2)[::2],
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_decode_equals_the_constructor_and_copies(form):
    for _ in range(20):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        B = int(rng.integers(1, 70))
        rows, kv = FORMS[form](rng.permutation(900)[:B]), FORMS[form](rng.integers(1, 5000, B))
        step = StepRows.decode(rows, kv)
        want = StepRows(rows, np.ones(B, np.int32), kv)
        assert step == want and step.decode_step and not want.decode_step, seed
        for name in ("rows", "q_lens", "kv_lens"):
            a = getattr(step, name)
            assert a.dtype == np.int32 and a.shape == (B,) and not a.flags.writeable, (seed, name)
        if isinstance(kv, np.ndarray):  # a copy: the engine's next in-place update does not reach the step
            kv += 1
            rows[0] += 1
            assert np.array_equal(step.kv_lens, want.kv_lens) and np.array_equal(step.rows, want.rows), seed


@pytest.mark.parametrize("rows, kv", [
    (np.zeros((2, 2), np.int32), np.ones(4, np.int32)),  # a 2-D int32 array is not taken as a vector
    (np.arange(3, dtype=np.int32), np.ones((3, 1), np.int32)),
    (np.arange(3, dtype=np.int32), np.array([1.0, 2.0, 3.0])),  # floats are never truncated
    (np.arange(3, dtype=np.int32), np.array([1, 2, 2**40])),  # past int32
    ([0, 1, "2"], [1, 2, 3]),
    (np.zeros((2, 2), np.int32), np.array([1.0, 2.0])),  # both wrong: the first field's error, as the constructor's
])
def test_decode_refuses_what_the_constructor_refuses(rows, kv):
    with pytest.raises(PlanError) as want:
        StepRows(rows, np.ones(len(kv), np.int32), kv)
    with pytest.raises(PlanError) as got:
        StepRows.decode(rows, kv)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_from_csr_equals_the_constructor_and_copies(form):
    for _ in range(20):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        B, ps = int(rng.integers(1, 70)), int(rng.choice([1, 16]))
        q, kv = rng.integers(1, 4, B), rng.integers(4, 3000, B)
        counts = -(-kv // ps) + rng.integers(0, 3, B)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        arrays = [FORMS[form](a) for a in (q, kv, indptr, rng.integers(0, 10**6, indptr[-1]))]
        batch = StepBatch.from_csr(*arrays, ps)
        want = StepBatch(*arrays, ps)
        assert batch == want and batch.block_table is None and batch.group_pages == () and batch.page_size == ps, seed
        for name, a in zip(("q_lens", "kv_lens", "page_indptr", "page_indices"), arrays):
            got = getattr(batch, name)
            assert got.dtype == np.int32 and got.shape == np.shape(a) and not got.flags.writeable, (seed, name)
            if isinstance(a, np.ndarray):  # a copy: the engine's next in-place update does not reach the step
                a += 1
                assert np.array_equal(got, getattr(want, name)), (seed, name)


@pytest.mark.parametrize("arrays, page_size", [
    ((np.ones(2, np.int32), np.ones(2, np.int32), np.zeros((1, 3), np.int32), np.zeros(2, np.int32)), 4),
    ((np.ones(2, np.int32), np.ones(2, np.int64) * 2**40, np.arange(3, dtype=np.int32), np.zeros(2, np.int32)), 4),
    ((np.ones(2, np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), np.zeros(2, np.float32)), 4),
    ((np.ones(2, np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), np.zeros(2, np.int32)), 0),
    ((np.ones(2, np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), np.zeros(2, np.int32)), True),
    ((np.ones(2, np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), np.zeros(2, np.int32)), 2**31),
])
def test_from_csr_refuses_what_the_constructor_refuses(arrays, page_size):
    """Inputs the one-copy path does not take (a 2-D or non-int32 array, a page size outside 1..int32) go to the
    constructor, which names the field."""
    with pytest.raises(PlanError) as want:
        StepBatch(*arrays, page_size)
    with pytest.raises(PlanError) as got:
        StepBatch.from_csr(*arrays, page_size)
    assert str(got.value) == str(want.value)
