"""H100: decode with attention sinks vs without, side by side in one run, per backend (FlashInfer: sinks
applied by the log-sum-exp, one fused Triton kernel; FlashAttention-4: its learnable sink).

gpt-oss's attention shape: 64 query / 8 KV heads, d 64, page 16; B = 64 requests of exactly `context`
(4,096) tokens; one layer's decode replayed from a captured graph (DecodeGraphs), CUDA-event medians of
50 replays, 5 interleaved rounds per arm (backend x with / without sinks), the same cache contents, the
same queries. The two arms of a backend differ only in LayerGroup(sinks=...) and the sinks passed to run.
Run on the GPU: python -m benchmarks.sinks_decode OUT_DIR   (writes sinks_decode_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch

from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, PoolLimits, StepBatch, build_plan, run
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.tuning import interleaved_rounds, median_spread

PS, H, KVH, D = 16, 64, 8, 64
BACKENDS = ("flashinfer", "flash_attn")


def _arm(backend: str, sinks: bool, B: int, context: int, kv: tuple, q: torch.Tensor, s: torch.Tensor):
    """One arm's captured decode graph (its replay, and what keeps it alive)."""
    pages = kv[0].shape[0] - 1
    spec = AttentionSpec(H, KVH, D, PS, pages, backend=backend, groups=(LayerGroup(sinks=sinks),))
    cache = PagedKVCache.from_tensors(*kv)  # (checked finite: FA4 reads whole pages)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=B, max_num_pages=pages, buckets=(B,),
                                            max_pages_per_request=context // PS + 8))

    def attend(step, x):
        step.mark_stored(cache)  # (timing: the cache is filled by hand)
        return run(step, x["q"], cache, sinks=s if sinks else None)

    graphs = DecodeGraphs(pool, attend, {"q": torch.zeros_like(q)})
    graphs.capture()
    ids = np.random.default_rng(B).permutation(pages)[: B * context // PS].astype(np.int32)
    batch = StepBatch.from_csr(np.ones(B, np.int32), np.full(B, context, np.int32),
                               np.arange(B + 1, dtype=np.int32) * (context // PS), ids, PS)
    step = pool.commit(build_plan(batch, spec))
    out = graphs(step, q=q).clone()
    return graphs.graph_for(step), out, (graphs, pool, cache)


def run_case(B: int, context: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(B)
    pages = B * context // PS + 64
    kv = tuple(torch.randn(pages + 1, PS, KVH, D, generator=gen, device="cuda").bfloat16() for _ in range(2))
    q = torch.randn(B, H, D, generator=gen, device="cuda").bfloat16()
    s = (1.0 + 2.0 * torch.randn(H, generator=gen, device="cuda")).float()  # gpt-oss-like sink logits
    arms, outs, keep = {}, {}, []
    for backend in BACKENDS:
        for sinks in (False, True):
            arms[(backend, sinks)], outs[(backend, sinks)], held = _arm(backend, sinks, B, context, kv, q, s)
            keep.append(held)
    t = interleaved_rounds({a: g.replay for a, g in arms.items()})
    res = dict(batch=B, context=context, backends={})
    for backend in BACKENDS:
        off, on = t[(backend, False)], t[(backend, True)]
        diff = (outs[(backend, True)].float() - outs[(backend, False)].float()).norm() / outs[(backend, False)].float().norm()
        res["backends"][backend] = dict(without_us=statistics.median(off), with_us=statistics.median(on),
                                        ratio=statistics.median(on) / statistics.median(off), without_rounds=off,
                                        with_rounds=on, output_change=float(diff))
    del keep, arms
    torch.cuda.empty_cache()
    return res


def markdown(r: dict) -> str:
    lines = ["# Decode with attention sinks vs without, H100", "",
             f"`python -m benchmarks.sinks_decode OUT`; {r['device']}, FlashInfer {r['flashinfer']}; one layer, {H}/{KVH} "
             f"heads, d {D}, page {PS}, every request exactly `context` tokens, replayed graphs, medians of 5 rounds x 50 "
             "replays (spread: min-max of the round medians). FlashInfer applies the sinks by its log-sum-exp "
             "(o * sigmoid(lse - s), one fused Triton kernel inside the graph: kernels/_sink_triton.py); FA4 by its learnable sink. Output change: "
             "||with - without|| / ||without|| (the sinks are not dropped).", "",
             "| backend | B | context | without µs | with µs | with / without | output change |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for x in r["cases"]:
        for name, b in x["backends"].items():
            lines.append(f"| {name} | {x['batch']} | {x['context']} | {median_spread(b['without_rounds'])} | "
                         f"{median_spread(b['with_rounds'])} | {b['ratio']:.3f} | {b['output_change']:.3f} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
         "cases": [run_case(B, ctx) for B, ctx in ((64, 4096), (8, 4096))]}
    json.dump(r, open(f"{out_dir}/sinks_decode_h100.json", "w"), indent=1)
    open(f"{out_dir}/sinks_decode_h100.md", "w").write(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
