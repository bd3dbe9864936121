"""capture/derive.py's Triton kernels on the H100, against its torch ops on the same staged slot (GPU only).
The CPU counterpart (Triton's interpreter) is tests/capture/test_derive.py."""

import pytest
import torch

from mstar_attn.capture import derive
from tests.capture.test_derive import random_listed_step, _random_step, check_fused_updates
from tests.capture.test_derive_cross import random_cross_step
from tests.helpers import fresh_seed
from tests.support.derived import check_again, copy_reads, derive_again

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


@pytest.mark.parametrize("copy_first", [False, True])
def test_the_triton_kernel_equals_the_torch_ops_on_the_gpu(copy_first, monkeypatch):
    """The kernel reads the staging in pinned host memory, as a pool's commit has it, or (copy_first: what
    derive.COPY_FIRST does past that many requests, here at every size) the head's copy in the slot buffer."""
    copy_reads(monkeypatch, copy_first)
    kernel = derive.triton_kernel()
    for ps, q_len in ((1, 1), (4, 1), (16, 1), (4, 5), (16, 16)):
        seed = fresh_seed()
        spec, pool, plan, _ = _random_step(seed, ps, q_len)  # (a CPU pool: the torch ops derive the step)
        step = pool.commit(plan)
        buf, offsets = derive_again(pool, step, kernel, "cuda")
        torch.cuda.synchronize()
        check_again(pool, step, buf, offsets, seed)
    for i, ps in enumerate((1, 4, 16, 1, 4, 16)):  # StepBatch decode steps, from the lists staged in pinned memory
        seed = fresh_seed()
        spec, pool, plan = random_listed_step(seed, ps, table=i % 2 == 1)
        step = pool.commit(plan)
        buf, offsets = derive_again(pool, step, kernel, "cuda")
        torch.cuda.synchronize()
        check_again(pool, step, buf, offsets, seed)
    for ps, sizes in ((1, (1, 16)), (4, (1, 16)), (16, (1, 16)), (4, (17, 32))):  # encoder-decoder decode steps: the
        seed = fresh_seed()                                                       # cross group from the cross table
        spec, pool, plan = random_cross_step(seed, ps, sizes)
        step = pool.commit(plan)
        buf, offsets = derive_again(pool, step, kernel, "cuda")
        torch.cuda.synchronize()
        check_again(pool, step, buf, offsets, seed)


@pytest.mark.parametrize("copy_first", [False, True])
def test_the_triton_kernel_applies_the_staged_updates_and_writes_the_fence_on_the_gpu(copy_first, monkeypatch):
    copy_reads(monkeypatch, copy_first)
    for _ in range(4):
        check_fused_updates(derive.triton_kernel(), "cuda", fresh_seed())
