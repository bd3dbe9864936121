"""H100: decode over an FP8 (e4m3) KV cache vs a bf16 one, side by side in one run, FlashInfer paged.

Three caches: bf16, FP8 read with bf16 math, FP8 with fp8_math (XQA). B requests of exactly `context` tokens (page 16, 32/8 heads, d 128), one layer's decode replayed
from a captured graph (DecodeGraphs), CUDA-event medians of 50 replays, 5 interleaved rounds per
format. Bytes: the K and V the kernel must read, B * context * 8 heads * 128 * 2 * bytes per value;
the copy ceiling is a 2 GiB device-to-device copy (bytes read + written over its time).
Run on the GPU: python -m benchmarks.fp8_decode OUT_DIR   (writes fp8_decode_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch

from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.tuning import event_median_us, interleaved_rounds

PS, H, KVH, D = 16, 32, 8, 128


def fill(cache: PagedKVCache, gen) -> None:
    n = cache.flat()[0].shape[0]
    for a in range(0, n, 1 << 16):
        idx = torch.arange(a, min(a + (1 << 16), n), device="cuda")
        cache.store(idx, *(torch.randn(idx.shape[0], KVH, D, generator=gen, device="cuda").bfloat16() for _ in range(2)))


def copy_ceiling_gbs() -> float:
    a = torch.randint(0, 255, (1 << 31,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = statistics.median(event_median_us(lambda: b.copy_(a), 10) for _ in range(3))
    del a, b
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / (us * 1e-6) / 1e9


def run_case(B: int, context: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(B)
    pages = B * context // PS + 64
    rng = np.random.default_rng(B)
    ids = rng.permutation(pages)[: B * context // PS].astype(np.int32)
    batch = StepBatch.from_csr(np.ones(B, np.int32), np.full(B, context, np.int32),
                               np.arange(B + 1, dtype=np.int32) * (context // PS), ids, PS)
    replays, out = {}, {}
    fp8 = dict(k_scale=0.02, v_scale=0.015)
    for name, kv_dtype, scales, math8 in (("bf16", None, {}, False), ("fp8_e4m3", torch.float8_e4m3fn, fp8, False),
                                          ("fp8_math", torch.float8_e4m3fn, fp8, True)):
        spec = AttentionSpec(H, KVH, D, PS, pages, kv_dtype=kv_dtype, fp8_math=math8)
        cache = PagedKVCache.allocate(spec, "cuda", **scales)
        fill(cache, gen)
        pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=B, max_num_pages=pages, buckets=(B,),
                                                max_pages_per_request=context // PS + 8))
        q = torch.randn(B, H, D, generator=gen, device="cuda").bfloat16()

        def attend(s, x, c=cache):
            s.mark_stored(c)  # (timing: the cache is filled by hand)
            return fi.run(s, x["q"], c)

        graphs = DecodeGraphs(pool, attend, {"q": torch.zeros_like(q)})
        graphs.capture()
        step = pool.commit(build_plan(batch, spec))
        graphs(step, q=q)
        replays[name] = graphs.graph_for(step)
        out[name] = (graphs, pool, cache)
    t = interleaved_rounds({name: g.replay for name, g in replays.items()})
    med = {k: statistics.median(v) for k, v in t.items()}
    bytes_ = {"bf16": 2, "fp8_e4m3": 1, "fp8_math": 1}
    res = dict(batch=B, context=context, bf16_us=med["bf16"], fp8_us=med["fp8_e4m3"], speedup=med["bf16"] / med["fp8_e4m3"],
               math_us=med["fp8_math"], math_speedup=med["bf16"] / med["fp8_math"],
               bf16_rounds=t["bf16"], fp8_rounds=t["fp8_e4m3"], math_rounds=t["fp8_math"])
    for name, key in (("bf16", "bf16"), ("fp8_e4m3", "fp8"), ("fp8_math", "math")):
        res[f"{key}_gbs"] = B * context * KVH * D * 2 * bytes_[name] / (med[name] * 1e-6) / 1e9
    del out, replays, attend
    torch.cuda.empty_cache()
    return res


def markdown(r: dict) -> str:
    lines = ["# FP8 (e4m3) vs bf16 KV cache, FlashInfer paged decode, H100", "",
             f"`python -m benchmarks.fp8_decode OUT`; {r['device']}, FlashInfer {r['flashinfer']}; one layer, 32/8 heads, "
             f"d 128, page 16, every request exactly `context` tokens, replayed graphs, medians of 5 rounds x 50 replays. "
             f"Copy ceiling (2 GiB device-to-device, read + write): {r['copy_gbs']:.0f} GB/s.", "",
             "FP8 = FP8 cache with bf16 math (FlashInfer's tensor-core decode); FP8 math = `AttentionSpec(fp8_math=True)` "
             "(FlashInfer's XQA Hopper FP8 kernel: queries and probabilities in e4m3). Spread: min-max of the 5 round medians.", "",
             "| B | context | bf16 µs | FP8 µs | FP8 math µs | FP8 speedup | FP8 math speedup | bf16 GB/s (% of copy) "
             "| FP8 GB/s (% of copy) | FP8 math GB/s (% of copy) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def us(x, key):
        v = x[f"{key}_rounds"]
        return f"{x[f'{key}_us']:.1f} ({min(v):.1f}-{max(v):.1f})"

    for x in r["cases"]:
        gbs = " | ".join(f"{x[f'{k}_gbs']:.0f} ({x[f'{k}_gbs'] / r['copy_gbs']:.0%})" for k in ("bf16", "fp8", "math"))
        lines.append(f"| {x['batch']} | {x['context']} | {us(x, 'bf16')} | {us(x, 'fp8')} | {us(x, 'math')} | "
                     f"{x['speedup']:.2f}x | {x['math_speedup']:.2f}x | {gbs} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "copy_gbs": copy_ceiling_gbs(),
         "cases": [run_case(B, ctx) for B, ctx in ((64, 4096), (16, 4096), (256, 2048))]}
    for x in r["cases"]:
        print(x["batch"], x["context"], f"{x['speedup']:.2f}x", f"{x['math_speedup']:.2f}x", flush=True)
    json.dump(r, open(f"{out_dir}/fp8_decode_h100.json", "w"), indent=1)
    open(f"{out_dir}/fp8_decode_h100.md", "w").write(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
