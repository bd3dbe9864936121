"""What run and write_kv are given is checked on the host, by name, before any kernel runs (CPU).

The checks live in mstar_attn.kernels._check and every backend calls them; here they run through
the reference backend (on plans and on committed steps of a CPU pool) and the FA4 backend with
its kernel replaced by a stand-in that must never be reached.
"""

import numpy as np
import pytest
import torch

from mstar_attn import LayerGroup, PagedKVCache, PlanError, PoolLimits, build_plan, kernels
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import flash_attn as fa
from mstar_attn.kernels import reference
from tests.helpers import fresh_seed, random_batch, spec_for

GROUPS = (LayerGroup(), LayerGroup("window", window=5))


def setup(dtype=torch.bfloat16, q_lens=(1, 1, 1), kv_lens=(5, 9, 20), backend="reference", head_dim=16):
    spec = spec_for(page_size=4, num_pages=64, groups=GROUPS, dtype=dtype, head_dim=head_dim, backend=backend)
    plan = build_plan(random_batch(np.random.default_rng(fresh_seed()), list(q_lens), list(kv_lens), 4, 64), spec)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=16, max_num_tokens=64, max_num_pages=64,
                                            buckets=(4, 8)), device="cpu")
    cache = PagedKVCache.allocate(spec)
    T, Hq, Hkv, D = plan.num_tokens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(T, Hq, D).to(dtype)
    k, v = torch.randn(T, Hkv, D).to(dtype), torch.randn(T, Hkv, D).to(dtype)
    return spec, plan, pool, cache, q, k, v


@pytest.mark.parametrize("on", ["plan", "step"])
def test_bad_arguments_are_named(on):
    spec, plan, pool, cache, q, k, v = setup()
    step = plan if on == "plan" else pool.commit(plan)
    T = plan.num_tokens
    cases = [
        (lambda: kernels.write_kv(step, k.float(), v.float(), cache), r"write_kv: k is torch.float32; this step takes torch.bfloat16"),
        (lambda: kernels.run(step, q[:-1], cache), r"run: q has 2 rows; this decode step takes 3"),
        (lambda: kernels.run(step, torch.cat([q, q]), cache), r"run: q has 6 rows"),
        (lambda: kernels.run(step, q.flatten(1), cache), r"run: q has shape \(3, 64\); expected \[rows, 4, 16\]"),
        (lambda: kernels.run(step, q[:, :2], cache), r"run: q has shape \(3, 2, 16\)"),
        (lambda: kernels.write_kv(step, k[:1], v, cache), r"write_kv: k has 1 rows"),
        (lambda: kernels.write_kv(step, k, v[:, :, :8], cache), r"write_kv: v has shape"),
        (lambda: kernels.run(step, q, cache, group=2), r"run: group 2 is out of range: the spec has 2 layer groups"),
        (lambda: kernels.run(step, q, cache, group=GROUPS[1]), r"run: group must be a layer-group index"),
        (lambda: kernels.run(step, q, cache, group=True), r"run: group must be a layer-group index"),
        (lambda: kernels.run(step, q, cache.k), r"run: cache must be a PagedKVCache"),
        (lambda: kernels.run(step, q.to("meta"), cache), r"run: q is on meta, the cache on cpu"),
        (lambda: kernels.run(step, None, cache), r"run: q must be a tensor"),
        (lambda: kernels.run(step, q, PagedKVCache(cache.k[:-1].contiguous(), cache.v[:-1].contiguous())),
         r"run: cache: cache is \(64, 4, 2, 16\).*scratch page"),
        (lambda: kernels.run(step, q, PagedKVCache(cache.k.float(), cache.v.float())), r"run: cache: cache is .*torch.float32"),
        (lambda: kernels.run("step", q, cache), r"run: step must be a DeviceStep"),
    ]
    for call, match in cases:
        with pytest.raises(PlanError, match=match):
            call()
    assert T == 3
    kernels.write_kv(step, k, v, cache)  # and the right arguments pass
    assert kernels.run(step, q, cache).shape == q.shape


def test_the_reference_oracle_takes_wider_queries_but_writes_only_the_cache_dtype():
    spec, plan, pool, cache, q, k, v = setup()
    kernels.write_kv(plan, k, v, cache)
    out = reference.run(plan, q.double(), cache)
    assert out.dtype == torch.float64
    with pytest.raises(PlanError, match="k is torch.float32"):  # the silent cast into a bf16 cache, refused
        reference.write_kv(plan, k.float(), v.float(), cache)


def test_a_bucketed_step_takes_its_padding_rows_and_nothing_else():
    spec, plan, pool, cache, q, k, v = setup()
    step = pool.commit(plan)  # 3 requests in bucket 4
    assert step.bucket == 4 and step.accepts_rows(3) and step.accepts_rows(4) and not step.accepts_rows(5)
    kernels.write_kv(step, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), cache)  # the padding row goes to the scratch page
    out = kernels.run(step, torch.cat([q, q[:1]]), cache)
    assert out.shape[0] == 4 and (out[3] == 0).all()  # the reference leaves padding rows zero
    with pytest.raises(PlanError, match=r"3 or b \* 1 for b in 3..4"):
        kernels.run(step, torch.cat([q, q, q]), cache)


def test_fa4_checks_before_its_kernel(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the kernel was reached with bad arguments")

    monkeypatch.setattr(fa, "_varlen_func", lambda: never)
    spec, plan, pool, cache, q, k, v = setup(head_dim=64, backend="flash_attn")
    step = pool.commit(plan)
    for call, match in [
        (lambda: fa.run(step, q[:2], cache), r"q has 2 rows"),
        (lambda: fa.run(step, q.half(), cache), r"q is torch.float16"),
        (lambda: fa.run(step, q, PagedKVCache(cache.k, cache.v)), r"known finite"),
        (lambda: fa.run(step, q, cache, group=-1), r"group -1 is out of range"),
        (lambda: fa.write_kv(step, k, v.float(), cache), r"v is torch.float32"),
    ]:
        with pytest.raises(PlanError, match=match):
            call()


def test_run_before_write_kv_is_refused():
    """run on a committed step whose new tokens no write_kv stored in this layer's cache reads stale
    slots: a PlanError naming write_kv and the token count, with or without k and v (k and v on a
    backend that reads the cache would be ignored). Another layer's write_kv does not count; an
    engine that stores K/V itself says so with step.mark_stored(cache); after write_kv the same
    call runs, equal to run without k and v; plans (the reference
    oracle) are not committed steps and are not checked.

    run(step, q, cache, k=k, v=v) on a backend that reads the cache, with no write_kv of the step into that cache
    (another layer's does not count):
    k and v would be ignored (and the step attend over stale slots), so it is a PlanError naming
    write_kv; after write_kv the same call runs, equal to run without k and v; plans (the reference
    oracle) are not committed steps and are not checked."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=64)
    plan = build_plan(random_batch(rng, [1, 3], [5, 9], 4, 64), spec)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=16, max_num_pages=64), device="cpu")
    cache = PagedKVCache.allocate(spec, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(plan.num_tokens, 4, 16, generator=gen)
    k, v = (torch.randn(plan.num_tokens, 2, 16, generator=gen) for _ in range(2))
    step = pool.commit(plan)
    with pytest.raises(PlanError, match="k and v are given.*call write_kv"):
        kernels.run(step, q, cache, 0, k, v)
    with pytest.raises(PlanError, match=f"this step's {plan.num_tokens} new tokens were not stored.*write_kv.*mark_stored"):
        kernels.run(step, q, cache, 0)
    engine_stored = pool.commit(plan)  # the engine stores K/V itself (here: the plan's slots, as a fused kernel would)
    cache_copy = PagedKVCache(cache.k.clone(), cache.v.clone())
    kernels.write_kv(plan, k, v, cache_copy)
    engine_stored.mark_stored(cache_copy)
    assert torch.equal(kernels.run(engine_stored, q, cache_copy, 0), reference.run(plan, q, cache_copy, 0)), seed
    step = pool.commit(plan)
    other = PagedKVCache.allocate(spec, "cpu")  # another layer's cache: its write_kv does not count for this one
    kernels.write_kv(step, k, v, other)
    with pytest.raises(PlanError, match="this layer's cache"):
        kernels.run(step, q, cache, 0, k, v)
    kernels.write_kv(step, k, v, cache)
    out = kernels.run(step, q, cache, 0, k, v)
    assert torch.equal(out, kernels.run(step, q, cache, 0)), seed
    assert torch.equal(reference.run(plan, q, cache, 0, k, v), out), seed  # (a plan: no check)
