"""The demo-shaped decode setup benchmarks/cold_host.py and benchmarks/demo_step_lines.py share: a FlashInfer pool of
8 / 2 heads of 64, page size 4, 4,000 pages, batches up to 8, and one decode graph per slot and bucket of one layer's
run over a cache of that spec (its K/V taken as stored). GPU only."""

import torch

from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import flashinfer as fi

B, PS = 4, 4  # the demo's typical decode batch and its page size


def decode_pool():
    """(spec, cache, pool, graphs): the pool and its captured one-layer decode graphs (input "q" [<= 8, 8, 64] bf16)."""
    spec = AttentionSpec(8, 2, 64, PS, 4000)
    cache = PagedKVCache.allocate(spec, "cuda")
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=256, max_num_pages=4000), device="cuda")
    static = {"q": torch.zeros(8, 8, 64, device="cuda", dtype=torch.bfloat16)}
    graphs = DecodeGraphs(pool, lambda s, x: fi.run(s, x["q"], cache) if s.mark_stored(cache) is None else None, static)
    graphs.capture()
    return spec, cache, pool, graphs
