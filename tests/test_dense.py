"""Dense (no KV cache) attention: plan validation and the reference path on the CPU, FA4 and
FlashInfer ragged against the reference on the GPU (marker gpu)."""

import numpy as np
import pytest
import torch

from mstar_attn import Kind, PlanError
from mstar_attn.dense import DenseAttention, DenseHeads, build_dense_plan
from tests.helpers import fresh_seed, naive_attention, rel_err


def random_qkv(seed, plan, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = lambda h: (plan.num_tokens, h, plan.head_dim)  # noqa: E731
    return tuple(torch.randn(shape(h), generator=gen).to(plan.dtype).to(device)
                 for h in (plan.num_qo_heads, plan.num_kv_heads, plan.num_kv_heads))


@pytest.mark.parametrize(
    "seq_lens, kw, match",
    [
        ([], {}, "non-empty 1-D"),
        ([[3, 4]], {}, "non-empty 1-D"),
        ([4, 0, 5], {}, r"seq_lens\[1\]: .* \(request 1\)"),
        ([4, 9, -2], {}, r"seq_lens\[2\]: .* \(request 2\)"),
        ([4.5, 3.0], {}, "must hold integers"),
        ([4], dict(heads=(6, 4, 64)), r"num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
        ([4], dict(heads=(8, 2, 0)), "head_dim must be positive"),
        ([4], dict(heads=(8, 0, 64)), "num_kv_heads must be positive"),
        ([4], dict(soft_cap=-1.0), "soft_cap must be >= 0"),
        ([4], dict(backend="flashinfer"), "not a dense backend"),
        ([4], dict(backend="flash_attn_varlen", dtype=torch.float32), "dtype: backend 'flash_attn_varlen'"),
        ([4], dict(backend="flashinfer_ragged", heads=(8, 2, 96)), "head_dim: backend 'flashinfer_ragged'"),
    ],
)
def test_build_dense_plan_rejects_bad_input(seq_lens, kw, match):
    heads = kw.pop("heads", (8, 2, 64))
    with pytest.raises(PlanError, match=match):
        build_dense_plan(seq_lens, DenseHeads(*heads), **kw)


def test_build_dense_plan_takes_the_heads_as_numbers_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="DenseHeads"):
        old = build_dense_plan([3, 4], 8, 2, 64, backend="reference", dtype=torch.float32)
    assert old == build_dense_plan([3, 4], DenseHeads(8, 2, 64), backend="reference", dtype=torch.float32)
    with pytest.warns(DeprecationWarning, match="DenseHeads"):  # the old numbers by name, too
        named = build_dense_plan([3, 4], num_qo_heads=8, num_kv_heads=2, head_dim=64, backend="reference",
                                 dtype=torch.float32)
    assert named == old
    with pytest.raises(PlanError, match="heads: expected a DenseHeads"):
        build_dense_plan([3, 4], 8, backend="reference", dtype=torch.float32)


def test_dense_plan_packs_the_sequences():
    lens = [3, 1, 200, 17]
    plan = build_dense_plan(lens, DenseHeads(8, 2, 64), causal=True, backend="reference", dtype=torch.float32)
    assert plan.cu_seqlens.tolist() == [0, 3, 4, 204, 221] and plan.cu_seqlens.dtype == np.int32
    assert (plan.max_seqlen, plan.num_tokens, plan.batch_size, plan.sm_scale) == (200, 221, 4, 64**-0.5)
    assert not plan.cu_seqlens.flags.writeable and not plan.seq_lens.flags.writeable
    assert plan == build_dense_plan(np.array(lens), DenseHeads(8, 2, 64), causal=True, backend="reference", dtype=torch.float32)
    with pytest.raises(AttributeError):
        plan.causal = False


# float64: exact up to summation order. float32: float32 accumulation over <= 300 keys, far
# under 1e-5. bf16: inputs identical on both sides, the output rounded once (<= 2^-9 relative).
REF_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("dtype", list(REF_TOL))
@pytest.mark.parametrize("causal, heads, soft_cap", [(False, (4, 4), 0.0), (True, (8, 2), 0.0), (False, (6, 2), 15.0)])
def test_reference_dense_matches_naive(dtype, causal, heads, soft_cap):
    seed = fresh_seed()
    lens = np.random.default_rng(seed).integers(1, 300, 5).tolist()
    plan = build_dense_plan(lens, DenseHeads(heads[0], heads[1], 32), causal=causal, soft_cap=soft_cap, dtype=dtype, backend="reference")
    q, k, v = random_qkv(seed, plan)
    out = DenseAttention(plan, device="cpu")(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    cu = plan.cu_seqlens
    want = torch.cat([
        naive_attention(q[cu[i] : cu[i + 1]], k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]],
                        kind=Kind.CAUSAL if causal else Kind.NONCAUSAL, window=None, scale=plan.sm_scale, soft_cap=soft_cap)
        for i in range(plan.batch_size)
    ])
    assert rel_err(out, want) < REF_TOL[dtype], (seed, lens)


def test_dense_attention_checks_row_counts():
    plan = build_dense_plan([3, 4], DenseHeads(2, 2, 16), backend="reference", dtype=torch.float32)
    q, k, v = random_qkv(0, plan)
    with pytest.raises(PlanError, match="the plan packs 7"):
        DenseAttention(plan, device="cpu")(q[:6], k[:6], v[:6])


# ---------------------------------------------------------------------------------------------
# GPU


def _why_not(module):
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        __import__(module)
    except ImportError as e:
        return f"needs {module}: {e}"
    return None


SKIP = {"flash_attn_varlen": _why_not("flash_attn.cute"), "flashinfer_ragged": _why_not("flashinfer")}
# Same inputs on both sides; the kernels round P to the input dtype before P@V and the output
# once (<= 2^-9 relative each for bf16), the reference computes in float32: well under 1e-2.
TOL = 1e-2


def gpu_backends():
    return [pytest.param(b, marks=[pytest.mark.gpu, pytest.mark.skipif(SKIP[b] is not None, reason=SKIP[b] or "")])
            for b in SKIP]


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize(
    "lens, heads, causal, dtype, soft_cap",
    [
        ([1024, 256, 77, 1], (16, 16), False, torch.bfloat16, 0.0),  # vision-tower shape: MHA, non-causal
        ([300, 5, 129], (32, 8), True, torch.float16, 0.0),
        ([513, 64], (8, 2), False, torch.bfloat16, 30.0),
    ],
)
def test_gpu_dense_matches_the_reference(backend, lens, heads, causal, dtype, soft_cap):
    seed = fresh_seed()
    plan = build_dense_plan(lens, DenseHeads(*heads, 128), causal=causal, soft_cap=soft_cap, dtype=dtype, backend=backend)
    ref_plan = build_dense_plan(lens, DenseHeads(*heads, 128), causal=causal, soft_cap=soft_cap, dtype=dtype, backend="reference")
    q, k, v = random_qkv(seed, plan, "cuda")
    out = DenseAttention(plan)(q, k, v)
    want = DenseAttention(ref_plan)(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, want) < TOL, (seed, backend, lens)


@pytest.mark.smoke
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_dense_replays_in_a_cuda_graph(backend):
    """DenseAttention's call launches kernels only: captured once, replayed on new inputs, equal to eager."""
    seed = fresh_seed()
    plan = build_dense_plan([700, 33, 256], DenseHeads(16, 16, 128), dtype=torch.bfloat16, backend=backend)
    attn = DenseAttention(plan)
    q, k, v = (t.clone() for t in random_qkv(seed, plan, "cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile
        attn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(q, k, v)
    for s in (seed + 1, seed + 2):
        for dst, src in zip((q, k, v), random_qkv(s, plan, "cuda")):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, attn(q, k, v)), (seed, backend)
