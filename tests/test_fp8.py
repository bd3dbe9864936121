"""FP8 KV caches (AttentionSpec.kv_dtype): the spec and the backends that serve it, scales, write_kv's
quantization round trip, and the reference backend over FP8 pages, per request."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, PagedKVCache, PlanError, StepBatch, build_plan
from mstar_attn.kernels import reference
from mstar_attn.metadata.select import graph_backends, table_backends
from tests.helpers import fresh_seed, random_batch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Rounding to FP8 (round to nearest): relative error <= 2^-(mantissa bits + 1) for normal values, and
# at most half the smallest subnormal below the smallest normal: e4m3 3 bits (2^-4; subnormal step
# 2^-9), e5m2 2 bits (2^-3; step 2^-16).
HALF_ULP = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


def _spec(kv_dtype=E4M3, backend="reference", dtype=torch.bfloat16, **kw):
    return AttentionSpec(4, 2, 16, 4, 64, dtype=dtype, kv_dtype=kv_dtype, backend=backend, **kw)


def test_the_spec_takes_fp8_kv_and_the_backends_that_serve_it():
    spec = _spec()
    assert spec.kv_cache_dtype == E4M3 and spec.fp8_kv and not _spec(None).fp8_kv
    assert _spec(torch.bfloat16).kv_cache_dtype == torch.bfloat16
    AttentionSpec(32, 8, 128, 16, 64, kv_dtype=E4M3, backend="flashinfer")
    for name in ("flash_attn", "flash_attn_varlen"):
        with pytest.raises(PlanError, match="spec.kv_dtype.*SM100"):
            AttentionSpec(32, 8, 128, 16, 64, kv_dtype=E4M3, backend=name)
    with pytest.raises(PlanError, match="spec.kv_dtype"):
        _spec(torch.float16)  # neither the query dtype nor FP8
    auto = AttentionSpec(32, 8, 128, 16, 64, kv_dtype=E4M3, backend="auto")
    assert not {"flash_attn", "flash_attn_varlen"} & set(table_backends(auto) + graph_backends(auto))


def test_scales_are_positive_floats_and_only_for_fp8_caches():
    cache = PagedKVCache.allocate(_spec(), k_scale=0.5, v_scale=2)
    assert cache.k.dtype == E4M3 and (cache.k_scale, cache.v_scale) == (0.5, 2.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(PlanError, match="k_scale"):
            PagedKVCache.allocate(_spec(), k_scale=bad)
    with pytest.raises(PlanError, match="scales are for FP8"):
        PagedKVCache.allocate(_spec(None), v_scale=0.5)
    with pytest.raises(PlanError, match="float8_e4m3fn"):  # a bf16 cache for an FP8 spec
        PagedKVCache.allocate(_spec(None)).check(_spec(), "run")


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_store_round_trips_within_the_quantization_step_and_saturates(fp8):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    scale = 0.01
    cache = PagedKVCache.allocate(_spec(fp8), k_scale=scale, v_scale=2 * scale)
    top = torch.finfo(fp8).max
    x = torch.randn(40, 2, 16, generator=gen) * torch.logspace(-7, 0.5, 40)[:, None, None]  # both subnormal ranges .. ~3x
    x[0, 0, 0], x[1, 1, 1] = 10 * top * scale, -10 * top * scale  # past the range: saturated
    slots = torch.randperm(cache.flat()[0].shape[0], generator=gen)[:40]
    cache.store(slots, x.bfloat16(), x.bfloat16())
    k, v = (t.view(-1, 2, 16)[slots] for t in cache.read(torch.arange(cache.k.shape[0]), torch.float64))
    rel, sub = HALF_ULP[fp8]
    for got, s in ((k, scale), (v, 2 * scale)):
        want = x.bfloat16().double().clamp(-top * s, top * s)
        bound = s * torch.maximum(rel * (want / s).abs(), torch.full_like(want, sub)) * (1 + 1e-6)
        assert ((got - want).abs() <= bound).all(), (f"seed {seed}", (got - want).abs().max().item())
    assert k[0, 0, 0] == top * scale and k[1, 1, 1] == -top * scale, f"seed {seed}"


def test_reference_over_fp8_pages_is_attention_over_the_dequantized_values():
    """The reference on an FP8 cache (scales folded in when it reads) equals the reference on a float32
    cache holding the dequantized values, bit for bit; the step's new K/V round-trip through write_kv."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec, spec32 = _spec(dtype=torch.float32), _spec(None, dtype=torch.float32)
    q_lens, kv_lens = [1, 3, 1, 9], [17, 12, 1, 9]
    batch = random_batch(rng, q_lens, kv_lens, 4, 64)
    plan, plan32 = build_plan(batch, spec), build_plan(batch, spec32)
    cache = PagedKVCache.allocate(spec, k_scale=0.02, v_scale=0.03)
    gen = torch.Generator().manual_seed(seed)
    every = torch.arange(cache.flat()[0].shape[0])
    cache.store(every, *(torch.randn(every.shape[0], 2, 16, generator=gen) for _ in range(2)))
    T = plan.num_tokens
    new_k, new_v = (torch.randn(T, 2, 16, generator=gen) for _ in range(2))
    reference.write_kv(plan, new_k, new_v, cache)
    q = torch.randn(T, 4, 16, generator=gen)
    out = reference.run(plan, q, cache)
    # the float32 twin holds what the FP8 cache now holds, new tokens included
    k, v = cache.read(torch.arange(cache.k.shape[0]), torch.float32)
    deq = PagedKVCache(k.view(cache.k.shape).contiguous(), v.view(cache.v.shape).contiguous())
    want = reference.run(plan32, q, deq)
    assert torch.equal(out, want), f"seed {seed}"
    slots = torch.tensor(plan.slot_mapping)
    for got, x, s in zip(cache.read(torch.arange(cache.k.shape[0]), torch.float64), (new_k, new_v), (0.02, 0.03)):
        x = x.double()  # elementwise: within half an e4m3 step of x / s (|x / s| stays far below 448 here)
        bound = s * torch.maximum(2.0**-4 * (x / s).abs(), torch.full_like(x, 2.0**-10)) * (1 + 1e-6)
        assert ((got.view(-1, 2, 16)[slots] - x).abs() <= bound).all(), f"seed {seed}"


def test_out_of_range_scales_and_non_finite_values():
    for bad in (2.0**101, 2.0**-101):
        with pytest.raises(PlanError, match="2\\^-100"):
            PagedKVCache.allocate(_spec(), k_scale=bad)
    with pytest.raises(PlanError, match="kv_dtype"):
        _spec([])
    assert _spec(torch.bfloat16) == _spec(None)  # kv_dtype equal to dtype is no kv_dtype at all
    cache = PagedKVCache.allocate(_spec(), k_scale=0.5)
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0]).view(4, 1, 1).expand(4, 2, 16).contiguous()
    cache.store(torch.arange(4), x, x)
    k, _ = cache.read(torch.arange(1), torch.float32)
    assert k[:3].isnan().all() and (k[3] == 1.0).all()  # an infinity is no finite stand-in
    with pytest.raises(PlanError, match="flashinfer_ragged.*FP8"):
        AttentionSpec(32, 8, 128, 16, 64, kv_dtype=E4M3, backend="flashinfer_ragged")


@pytest.mark.parametrize("change,field", [
    (dict(kv_dtype=None), "kv_dtype float8_e4m3fn"), (dict(kv_dtype=torch.float8_e5m2), "kv_dtype float8_e4m3fn"),
    (dict(page_size=1), "page size"), (dict(page_size=8), "page size"), (dict(soft_cap=30.0), "soft cap"),
    (dict(backend="flash_attn"), "backend flashinfer"), (dict(fp8_math=1), "expected a bool"),
])
def test_fp8_math_needs_what_xqa_serves(change, field):
    """fp8_math (XQA FP8 decode) is refused at spec construction where XQA cannot serve it, naming why."""
    kw = {**dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=100,
                 kv_dtype=torch.float8_e4m3fn, fp8_math=True), **change}
    with pytest.raises(PlanError, match=f"spec.fp8_math.*{field}"):
        AttentionSpec(**kw)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_fp8_math_specs_plan_like_fp8_specs_and_the_reference_computes_exactly(page_size):
    """An fp8_math spec plans exactly as the same spec without it (the flag changes only the decode
    kernel), `auto` keeps FlashInfer, and the reference (the oracle) computes as over any FP8 cache."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    base = AttentionSpec(8, 2, 64, page_size, 400, kv_dtype=torch.float8_e4m3fn, dtype=torch.float32, backend="reference")
    spec = AttentionSpec(8, 2, 64, page_size, 400, kv_dtype=torch.float8_e4m3fn, dtype=torch.float32, fp8_math=True,
                         backend="reference")
    auto = AttentionSpec(8, 2, 64, page_size, 400, kv_dtype=torch.float8_e4m3fn, fp8_math=True, backend="auto")
    batch = random_batch(rng, [1] * 5, rng.integers(1, 300, 5), page_size, 400)
    a, b = build_plan(batch, base), build_plan(batch, spec)
    for name in ("qo_indptr", "kv_lens", "positions"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), (f"seed {seed}", name)
    assert table_backends(auto)[0] == "flashinfer" and all(n != "flash_attn" for n in table_backends(auto))
    cache = PagedKVCache.allocate(spec, k_scale=0.05, v_scale=0.03)
    n = cache.flat()[0].shape[0]
    gen = torch.Generator().manual_seed(seed)
    cache.store(torch.arange(n), torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen))
    q = torch.randn(5, 8, 64, generator=gen)
    assert torch.equal(reference.run(a, q, cache), reference.run(b, q, cache)), f"seed {seed}"


def test_fp8_math_refuses_gqa_ratios_xqa_cannot_compile():
    with pytest.raises(PlanError, match="GQA ratio of at most 128"):
        AttentionSpec(256, 1, 128, 16, 100, kv_dtype=torch.float8_e4m3fn, fp8_math=True)
    AttentionSpec(128, 1, 128, 16, 100, kv_dtype=torch.float8_e4m3fn, fp8_math=True)
