"""Latent attention (MLA, AttentionSpec.mla_rope_dim): the spec, the cache layout, write_kv, and the
reference backend's absorbed form against the decompressed multi-head attention it stands for,
per request, for decode, verify, prefill and extend steps."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, PlanError, build_plan
from mstar_attn.kernels import reference
from tests.helpers import fresh_seed, random_batch

H, DC, DR, D_NOPE, D_V = 16, 64, 16, 32, 24  # heads, latent (c_kv), RoPE key, per-head nope and value dims


def _spec(ps=16, dtype=torch.float64, **kw):
    return AttentionSpec(H, 1, DC, ps, 600, dtype=dtype, mla_rope_dim=DR, sm_scale=(D_NOPE + DR) ** -0.5,
                         backend="reference", **kw)


def test_the_spec_and_its_cache_layout():
    spec = AttentionSpec(128, 1, 512, 64, 100, mla_rope_dim=64, sm_scale=192**-0.5, backend="reference")
    cache = PagedKVCache.allocate(spec)
    assert spec.mla and cache.k.shape == (101, 64, 1, 512) and cache.v.shape == (101, 64, 1, 64)
    cache.check(spec, "here")
    with pytest.raises(PlanError, match="one KV head"):
        AttentionSpec(16, 2, 512, 16, 10, mla_rope_dim=64, backend="reference")
    with pytest.raises(PlanError, match="mla_rope_dim"):
        AttentionSpec(16, 1, 512, 16, 10, mla_rope_dim=-1, backend="reference")
    for name in ("flashinfer", "flash_attn"):  # not served yet: refused when the spec is made
        with pytest.raises(PlanError, match="spec.mla_rope_dim.*latent attention"):
            AttentionSpec(16, 1, 128, 16, 10, mla_rope_dim=64, backend=name)
    with pytest.raises(PlanError, match="the spec needs"):  # a plain cache for an MLA spec
        PagedKVCache.allocate(AttentionSpec(16, 1, 512, 64, 100, backend="reference")).check(spec, "run")


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("q_lens, kv_lens", [([1] * 6, [40, 1, 7, 300, 64, 65]), ([4] * 3, [9, 70, 4]),
                                             ([5, 30, 1], [5, 30, 1]), ([3, 17, 1], [90, 40, 12])],
                         ids=["decode", "verify", "prefill", "extend"])
def test_the_absorbed_form_is_the_decompressed_attention(ps, q_lens, kv_lens):
    """Keys c_kv W_UK^h plus the shared k_pe, values c_kv W_UV^h, per head (float64): the reference's
    absorbed output (q_nope W_UK^h against c_kv, then W_UV^h) equals it per request; write_kv stores
    the step's c_kv and k_pe where the plan says."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = _spec(ps)
    plan = build_plan(random_batch(rng, q_lens, kv_lens, ps, 600), spec)
    w_uk = torch.randn(H, D_NOPE, DC, generator=gen, dtype=torch.float64) / DC**0.5
    w_uv = torch.randn(H, DC, D_V, generator=gen, dtype=torch.float64) / DC**0.5
    cache = PagedKVCache.allocate(spec)
    c_kv = [torch.randn(int(n), DC, generator=gen, dtype=torch.float64) for n in plan.kv_lens]  # each request's tokens
    k_pe = [torch.randn(int(n), DR, generator=gen, dtype=torch.float64) for n in plan.kv_lens]
    kf, vf = cache.flat()
    for i in range(plan.batch_size):  # the cached prefix, straight into its pages
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
        prefix = int(plan.kv_lens[i] - plan.q_lens[i])
        slots = torch.tensor([pages[t // ps] * ps + t % ps for t in range(prefix)], dtype=torch.long)
        kf[slots] = c_kv[i][:prefix, None]
        vf[slots] = k_pe[i][:prefix, None]
    new = lambda xs: torch.cat([x[int(n) - int(q):] for x, n, q in zip(xs, plan.kv_lens, plan.q_lens)])[:, None]  # noqa: E731
    reference.write_kv(plan, new(c_kv), new(k_pe), cache)
    q_nope = torch.randn(plan.num_tokens, H, D_NOPE, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(plan.num_tokens, H, DR, generator=gen, dtype=torch.float64)
    q = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)  # absorbed: [T, H, DC + DR]
    out = torch.einsum("thc,hcv->thv", reference.run(plan, q, cache), w_uv)
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        n = int(plan.kv_lens[i])
        k = torch.cat([torch.einsum("kc,hnc->hkn", c_kv[i], w_uk), k_pe[i][None].expand(H, -1, -1)], -1)  # [H, n, D_NOPE + DR]
        v = torch.einsum("kc,hcv->hkv", c_kv[i], w_uv)
        logits = torch.einsum("qhd,hkd->hqk", torch.cat([q_nope[a:b], q_pe[a:b]], -1), k) * spec.sm_scale
        pos = torch.arange(n - (b - a), n)[:, None]
        logits = logits.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        want = torch.einsum("hqk,hkv->qhv", torch.softmax(logits, -1), v)
        err = ((out[a:b] - want).norm() / want.norm()).item()
        assert err < 1e-12, (f"seed {seed}", f"request {i}", err)
    slots = torch.tensor(plan.slot_mapping)
    assert torch.equal(kf[slots, 0], new(c_kv)[:, 0]) and torch.equal(vf[slots, 0], new(k_pe)[:, 0]), f"seed {seed}"


def test_shapes_are_checked():
    spec = _spec(16, dtype=torch.float32)
    plan = build_plan(random_batch(np.random.default_rng(0), [1, 1], [5, 9], 16, 600), spec)
    cache = PagedKVCache.allocate(spec)
    with pytest.raises(PlanError, match=rf"q has shape .*expected \[rows, {H}, {DC + DR}\]"):
        reference.run(plan, torch.randn(2, H, DC), cache)
    with pytest.raises(PlanError, match=rf"v has shape .*expected \[rows, 1, {DR}\]"):
        reference.write_kv(plan, torch.randn(2, 1, DC), torch.randn(2, 1, DC), cache)


def test_mla_backend_refuses_what_it_cannot_serve():
    with pytest.raises(PlanError, match="latent attention"):
        AttentionSpec(16, 8, 128, 16, 100, backend="flashinfer_mla")
    with pytest.raises(PlanError, match="latent attention"):
        AttentionSpec(16, 1, 512, 16, 100, mla_rope_dim=64, backend="flash_attn")
    spec = AttentionSpec(16, 1, 512, 16, 1000, mla_rope_dim=64, backend="auto")
    assert build_plan(random_batch(np.random.default_rng(0), [1, 1], [30, 40], 16, 1000), spec).backend == "flashinfer_mla"


@pytest.mark.parametrize("kw,why", [
    (dict(soft_cap=30.0), "soft cap"), (dict(mla_rope_dim=32), "multiple of 64"), (dict(num_qo_heads=24), "head count"),
    (dict(groups=(LayerGroup("window", window=64),)), "causal or non-causal"),
])
@pytest.mark.parametrize("backend", ["flashinfer_mla", "auto"])
def test_flashinfer_mla_refuses_what_its_kernels_cannot_express(kw, why, backend):
    """Refused at spec construction (not mid-commit, not silently wrong); the reference serves all of it."""
    base = dict(num_qo_heads=16, num_kv_heads=1, head_dim=512, page_size=16, num_pages=100, mla_rope_dim=64)
    with pytest.raises(PlanError, match=why):
        AttentionSpec(**{**base, **kw, "backend": backend})
    AttentionSpec(**{**base, **kw, "backend": "reference", "dtype": torch.float32})
