"""pytest-benchmark of build_plan (CPU). Run: python -m pytest benchmarks --benchmark-only."""

import pytest

from benchmarks import cases
from mstar_attn import build_plan

STEPS = {
    "decode_b1": lambda: cases.decode(1),
    "decode_b64": lambda: cases.decode(64),
    "decode_b256": lambda: cases.decode(256),
    "mixed_60x1+4x512": lambda: cases.mixed(),
}


@pytest.mark.parametrize("check_ownership", [True, False], ids=["all-checks", "no-ownership-scan"])
@pytest.mark.parametrize("step", list(STEPS))
def test_build_plan(benchmark, step, check_ownership):
    batch, spec = STEPS[step](), cases.spec()
    benchmark.group = step
    plan = benchmark.pedantic(build_plan, (batch, spec), {"check_ownership": check_ownership}, rounds=300, iterations=10, warmup_rounds=20)
    assert plan.batch_size == batch.batch_size


def test_step_batch_snapshot(benchmark):
    """What an engine pays to snapshot its arrays into an immutable StepBatch (B = 256 decode)."""
    b = cases.decode(256)
    q, kv, indptr, idx = (a.copy() for a in (b.q_lens, b.kv_lens, b.page_indptr, b.page_indices))
    benchmark.group = "decode_b256"
    benchmark.pedantic(lambda: cases.StepBatch.from_csr(q, kv, indptr, idx, cases.PAGE), rounds=300, iterations=10)
