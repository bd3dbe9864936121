"""capture/derive.py's Triton kernels on the H100, against its torch ops on the same staged slot (GPU only).
The CPU counterpart (Triton's interpreter) is tests/capture/test_derive.py."""

import pytest
import torch

from mstar_attn.capture import derive
from tests.capture.test_derive import _random_step, derive_again
from tests.helpers import fresh_seed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


def test_the_triton_kernels_equal_the_torch_ops_on_the_gpu():
    kernels = derive.triton_kernels()
    for ps, q_len in ((1, 1), (4, 1), (16, 1), (4, 5), (16, 16)):
        seed = fresh_seed()
        spec, pool, plan, _ = _random_step(seed, ps, q_len)  # (a CPU pool: the torch ops derive the step)
        step = pool.commit(plan)
        buf, offsets = derive_again(pool, step, kernels, "cuda")
        torch.cuda.synchronize()
        assert torch.equal(buf[: offsets.head_end].cpu(), pool.dev[step.slot][: offsets.head_end]), f"seed {seed}"
        for dg, o in zip(step.groups, offsets.groups):
            o_idx = o.indices
            n = int(dg.kv_indptr[-1])
            assert torch.equal(buf[o_idx : o_idx + n].cpu(), dg.kv_indices[:n]), f"seed {seed}"
