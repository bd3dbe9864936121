"""PagedKVCache: shapes checked at construction, the scratch page allocated, finiteness known or checked."""

import pytest
import torch

from mstar_attn import PagedKVCache, PlanError
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
