"""capture/limits.py: a pool's bounds as one PoolLimits record; the old keyword form still served, with a
DeprecationWarning; every misuse of the two forms a PlanError naming what is wrong."""

import pytest

from mstar_attn import GraphBufferPool, PlanError, PoolLimits
from tests.helpers import spec_for

LIMITS = dict(max_batch_size=8, max_num_tokens=8, max_num_pages=8)


def test_a_pool_takes_its_bounds_as_one_record():
    pool = GraphBufferPool(spec_for(), PoolLimits(**LIMITS, buckets=(1, 4), max_requests=3), device="cpu")
    assert pool.limits.max_requests == 3 and pool.buckets == (1, 4) and pool.table.max_requests == 3


def test_the_bounds_as_keywords_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="PoolLimits"):
        old = GraphBufferPool(spec_for(), **LIMITS, buckets=(2,), device="cpu")
    assert old.limits == PoolLimits(**LIMITS, buckets=(2,)) and old.buckets == (2,)


@pytest.mark.parametrize("args, kw, match", [
    ((), dict(LIMITS, scheduler_option_typo=1), "unknown arguments .'scheduler_option_typo'"),
    ((PoolLimits(**LIMITS),), dict(max_batch_size=8), "bounds given twice"),
    ((dict(LIMITS),), {}, "limits: expected a PoolLimits, got dict"),
    ((), dict(max_batch_size=8), r"missing \['max_num_tokens', 'max_num_pages'\]"),
    ((PoolLimits(**dict(LIMITS, max_num_tokens=0)),), {}, "max_num_tokens"),
])
def test_misuse_is_a_plan_error_naming_it(args, kw, match):
    with pytest.raises(PlanError, match=match):
        GraphBufferPool(spec_for(), *args, device="cpu", **kw)


def test_a_pool_without_a_device_takes_cuda_when_torch_sees_one_else_the_cpu():
    import torch

    spec = spec_for()  # (the reference backend: it runs on either)
    pool = GraphBufferPool(spec, PoolLimits(**LIMITS))
    assert pool.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
