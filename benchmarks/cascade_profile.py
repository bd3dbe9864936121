"""H100 probe: the kernels of one eager cascade decode step (GQA 4, 1k shared + 128 own tokens) at
buckets 8 / 16 / 32 (B = 8, 12, 16, 24, 32), torch.profiler over 10 steps each.
Run: python -m benchmarks.cascade_profile (results/cascade_profile_h100.txt)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cascade_grid import D, KVH, PS, batch_of
from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, build_plan
from mstar_attn.capture.pool import GraphBufferPool


def main(gqa: int = 4) -> None:
    from mstar_attn.kernels import flashinfer as fi

    shapes = [dict(gqa=gqa, B=B, families=1, shared=1024, suffix=128) for B in (8, 12, 16, 24, 32)]
    pages = max(batch_of(s, 0)[1] for s in shapes) + 8
    spec = AttentionSpec(KVH * gqa, KVH, D, PS, pages, cascade="always")
    cache = PagedKVCache.allocate(spec, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=256, max_num_pages=40000))
    for s in shapes:
        batch, _ = batch_of(s, 1)
        step = pool.commit(build_plan(batch, spec))
        step.mark_stored(cache)  # (the cache is filled by hand)
        q = torch.randn(step.padded_batch_size, KVH * gqa, D, device="cuda").bfloat16()
        for _ in range(3):
            fi.run(step, q, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fi.run(step, q, cache)
            torch.cuda.synchronize()
        print(f"== B{s['B']} bucket {step.bucket} rows {step.padded_batch_size}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=90))


if __name__ == "__main__":
    main()
