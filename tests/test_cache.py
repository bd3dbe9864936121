"""PagedKVCache: shapes checked at construction, the scratch page allocated, finiteness known or checked."""

import pytest
import torch

from mstar_attn import AttentionSpec, PagedKVCache, PlanError, PoolLimits
from tests.helpers import spec_for


def test_allocate_makes_the_specs_shape_zeroed_and_finite():
    spec = spec_for(page_size=4, num_pages=10, dtype=torch.bfloat16)
    cache = PagedKVCache.allocate(spec)
    assert cache.k.shape == spec.cache_shape == (11, 4, 2, 16) and cache.k.dtype == torch.bfloat16
    assert cache.finite and not cache.k.any() and cache.page_size == 4
    cache.check(spec, "here")
    k_flat, _ = cache.flat()
    assert k_flat.shape == (44, 2, 16) and k_flat.data_ptr() == cache.k.data_ptr()


def test_from_tensors_checks_every_element_once():
    k, v = torch.randn(9, 4, 2, 16), torch.randn(9, 4, 2, 16)
    assert PagedKVCache.from_tensors(k, v).finite
    assert not PagedKVCache(k, v).finite  # unchecked
    for bad in (float("nan"), float("inf")):
        v2 = v.clone()
        v2[8, 3, 1, 15] = bad  # the last element: the chunked scan reaches it
        with pytest.raises(PlanError, match="non-finite"):
            PagedKVCache.from_tensors(k, v2)


@pytest.mark.parametrize("k, v, match", [
    (torch.zeros(4, 2, 16), torch.zeros(4, 2, 16), "contiguous \\[pages, page_size, kv_heads, head_dim\\]"),
    (torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 1, 16), "k and v differ"),
    (torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16, dtype=torch.float16), "k and v differ"),
    (torch.zeros(3, 4, 16, 2).transpose(2, 3), torch.zeros(3, 4, 2, 16), "not contiguous"),
    ("k", torch.zeros(3, 4, 2, 16), "expected a tensor"),
])
def test_malformed_caches_are_refused(k, v, match):
    with pytest.raises(PlanError, match=match):
        PagedKVCache(k, v)


def test_a_cache_without_the_scratch_page_does_not_fit_the_spec():
    spec = spec_for(page_size=4, num_pages=10)
    with pytest.raises(PlanError, match="scratch page"):
        PagedKVCache(torch.zeros(10, 4, 2, 16), torch.zeros(10, 4, 2, 16)).check(spec, "run: cache")


def test_a_v_of_another_width_fits_only_a_latent_attention_spec():
    spec = spec_for(page_size=4, num_pages=10)
    with pytest.raises(PlanError, match="the spec needs"):
        PagedKVCache(torch.zeros(11, 4, 2, 16), torch.zeros(11, 4, 2, 8)).check(spec, "run: cache")


@pytest.mark.parametrize("change, words", [
    (dict(page_size=8), "page size 8, the spec's is 4"),
    (dict(dtype=torch.float16), "dtype torch.float16, the spec's KV dtype is torch.float32"),
    (dict(heads=(4, 1)), "1 KV heads, the spec has 2"),
    (dict(head_dim=32), "head_dim 32, the spec's is 16"),
    (dict(num_pages=10), "11 pages, fewer than num_pages \\+ 1 = 17"),
])
def test_a_cache_that_does_not_fit_says_which_part_differs(change, words):
    spec = spec_for(page_size=4, num_pages=16)
    cache = PagedKVCache.allocate(spec_for(**{"page_size": 4, "num_pages": 16, **change}))
    with pytest.raises(PlanError, match=f"run: cache is .*, the spec needs \\(17, 4, 2, 16\\) torch.float32: {words}"):
        cache.check(spec, "run")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_cuda_cache_or_pool_on_a_machine_without_cuda_is_a_plan_error():
    from mstar_attn.capture.pool import GraphBufferPool

    spec = spec_for(page_size=4, num_pages=16)
    with pytest.raises(PlanError, match="sees no CUDA device"):
        PagedKVCache.allocate(spec, "cuda")
    with pytest.raises(PlanError, match="sees no CUDA device; a CPU pool is device='cpu'"):
        GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=8, max_num_pages=16), device="cuda")


def test_a_backend_whose_package_is_missing_says_how_to_get_it():
    from mstar_attn.metadata import backends, select

    missing = [n for n, c in backends.BACKENDS.items() if c.package and not select.installed(n)]
    if not missing:
        pytest.skip("every GPU package is installed here")
    with pytest.raises(ImportError, match=f"backend '{missing[0]}' needs the .* package .*pip install 'mstar_attn\\[gpu\\]'"):
        backends.load(missing[0])



def test_move_reads_every_source_before_writing_and_moves_fp8_bytes():
    """PagedKVCache.move with overlapping moves (a slot both read and written) equals moving from a snapshot;
    an FP8 cache's bytes move unchanged."""
    for dtype in (torch.float32, torch.float8_e4m3fn):
        spec = AttentionSpec(4, 2, 16, 4, 8, dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16,
                             kv_dtype=None if dtype == torch.float32 else dtype, backend="reference")
        cache = PagedKVCache.allocate(spec, "cpu")
        k = torch.randn(cache.flat()[0].shape[0], 2, 16)
        cache.store(torch.arange(k.shape[0]), k, -k)
        before = [x.view(torch.uint8).clone() if dtype != torch.float32 else x.clone() for x in cache.flat()]
        src, dst = torch.tensor([4, 5, 6, 3]), torch.tensor([5, 6, 7, 9])  # (5, 6 read and written: an in-order copy fails)
        cache.move(src, dst)
        for flat, old in zip(cache.flat(), before):
            now = flat.view(torch.uint8) if dtype != torch.float32 else flat
            assert torch.equal(now[dst], old[src]) and torch.equal(now[:4], old[:4]) and torch.equal(now[10:], old[10:])
