"""FlashInfer latent attention (backend "flashinfer_mla") through the pool: decode and verify replayed,
prefill and extend eager, every request against the reference's absorbed form (GPU only). The
reference itself equals the decompressed multi-head attention (tests/test_mla.py).

Bound: the usual bf16 one (tests/helpers.py): both sides read the same bf16 cache, the kernel
rounds P once before P @ c_kv and its output once."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, PoolLimits, build_plan
from mstar_attn.kernels import reference
from tests.helpers import smoke_first, assert_close_per_request, attend_filled, fresh_seed, random_batch, random_cache

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from mstar_attn.capture.graphs import DecodeGraphs  # noqa: E402
from mstar_attn.capture.pool import GraphBufferPool  # noqa: E402
from mstar_attn.kernels import flashinfer_mla as mla  # noqa: E402

CKV, ROPE = 512, 64


@pytest.mark.parametrize("page_size,heads", smoke_first([(1, 16), (16, 16), (64, 16), (16, 128)], lambda c: c == (16, 16)))
def test_mla_eager_and_replayed(page_size, heads):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = 80000 // page_size
    spec = AttentionSpec(heads, 1, CKV, page_size, num_pages, mla_rope_dim=ROPE, sm_scale=192**-0.5, backend="flashinfer_mla")
    cache = random_cache(spec, seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=32, max_num_tokens=1024, max_num_pages=num_pages,
                                            buckets=(8, 32), max_pages_per_request=2400 // page_size + 2))
    graphs = DecodeGraphs(pool, attend_filled(mla.run, cache),  # (write_kv: eagerly, below)
                          {"q": torch.zeros(32 * 4, heads, CKV + ROPE, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(1, 4))
    shapes = {"decode": lambda B: ([1] * B, rng.integers(1, 2000, B)),
              "verify": lambda B: ([4] * B, rng.integers(5, 2000, B)),
              "prefill": lambda B: (rng.integers(1, 200, B), None),
              "extend": lambda B: (rng.integers(2, 100, B), rng.integers(200, 1500, B))}
    ran = {}
    for i in range(16):
        mode = ["decode", "verify", "prefill", "extend"][i % 4]
        B = int(rng.integers(1, 32 if mode in ("decode", "verify") else 6))
        q_lens, kv = shapes[mode](B)
        kv_lens = q_lens if kv is None else kv
        plan = build_plan(random_batch(rng, q_lens, kv_lens, page_size, num_pages), spec)
        step = pool.commit(plan)
        mla.write_kv(step, torch.randn(plan.num_tokens, 1, CKV, generator=gen, device="cuda").bfloat16(),
                     torch.randn(plan.num_tokens, 1, ROPE, generator=gen, device="cuda").bfloat16(), cache)
        q = torch.randn(plan.num_tokens, heads, CKV + ROPE, generator=gen, device="cuda").bfloat16()
        replay = graphs.serves(step)
        out = graphs(step, q=q) if replay else mla.run(step, q, cache)
        assert out.shape == (plan.num_tokens, heads, CKV), (f"seed {seed}", out.shape)
        want = reference.run(plan, q.float(), cache)
        assert_close_per_request(out, want, plan, torch.bfloat16, (f"seed {seed}", i, mode, f"replayed {replay}"))
        ran[(mode, replay)] = ran.get((mode, replay), 0) + 1
    assert ran.get(("decode", True), 0) >= 2 and ran.get(("verify", True), 0) >= 2, (f"seed {seed}", ran)
