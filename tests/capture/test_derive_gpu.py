"""capture/derive.py's Triton kernels on the H100, against its torch ops on the same staged slot (GPU only).
The CPU counterpart (Triton's interpreter) is tests/capture/test_derive.py."""

import pytest
import torch

from mstar_attn.capture import derive
from mstar_attn.capture.layout import slot_views
from tests.capture.test_derive import _random_step
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
        s, R, N = step.slot, step.rows, step.num_rows
        offsets = slot_views(pool.layout, pool.dev[s], pool.host[s], R, N)[0]
        buf = pool.dev[s].clone().cuda()
        for o_ptr, o_lpl, o_len, o_first, o_idx in offsets.groups:  # forget what the torch ops derived
            for a, n in ((o_ptr, R + 1), (o_lpl, R), (o_len, R), (o_first, R), (o_idx, pool.layout.index_capacity)):
                buf[a : a + n] = -7
        buf[offsets.qo : offsets.qo + R + 1] = -7
        buf[offsets.slots : offsets.slots + 2 * N] = -7
        d = pool.derivation
        derive.derive_rows(buf, offsets, q_len,
                           derive.Derivation(d.table.cuda(), d.width, spec.groups, ps, d.capacity, kernels))
        torch.cuda.synchronize()
        assert torch.equal(buf[: offsets.head_end].cpu(), pool.dev[s][: offsets.head_end]), f"seed {seed}"
        for dg, (*_, o_idx) in zip(step.groups, offsets.groups):
            n = int(dg.kv_indptr[-1])
            assert torch.equal(buf[o_idx : o_idx + n].cpu(), dg.kv_indices[:n]), f"seed {seed}"
