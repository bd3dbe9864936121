"""H100: latent-attention (MLA) decode bandwidth against the copy ceiling, ours vs the raw FlashInfer call.

DeepSeek shapes: c_kv 512 + k_pe 64 per token, bf16, one KV head; B requests of exactly `context`
tokens on random pages. Side by side in one run: our "flashinfer_mla" backend replayed from a
DecodeGraphs graph (pool commit outside it), and FlashInfer's BatchMLAPagedAttentionWrapper planned
and captured by hand over the same cache and pages. CUDA-event medians of 50 replays, 5 interleaved
rounds. Bytes: B * context * 576 * 2 (the cache read once; queries and outputs are under 1%).
Run on the GPU: python -m benchmarks.mla_decode OUT_DIR   (writes mla_decode_h100.json / .md)
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
from mstar_attn.kernels import flashinfer_mla as mla
from mstar_attn.tuning import interleaved_rounds, median_spread

CKV, ROPE = 512, 64
CASES = [(16, 64, 4096), (16, 128, 4096), (128, 64, 4096), (128, 16, 8192), (16, 1, 4096)]  # heads, B, context


def run_case(heads: int, B: int, context: int, ps: int = 64) -> dict:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    gen = torch.Generator(device="cuda").manual_seed(B * heads)
    pages = B * context // ps + 16
    spec = AttentionSpec(heads, 1, CKV, ps, pages, mla_rope_dim=ROPE, sm_scale=192**-0.5, backend="flashinfer_mla")
    cache = PagedKVCache.allocate(spec, "cuda")
    n = cache.flat()[0].shape[0]
    for a in range(0, n, 1 << 18):
        idx = torch.arange(a, min(a + (1 << 18), n), device="cuda")
        cache.store(idx, torch.randn(idx.shape[0], 1, CKV, generator=gen, device="cuda"),
                    torch.randn(idx.shape[0], 1, ROPE, generator=gen, device="cuda"))
    ids = np.random.default_rng(B).permutation(pages)[: B * context // ps].astype(np.int32)
    indptr = np.arange(B + 1, dtype=np.int32) * (context // ps)
    batch = StepBatch.from_csr(np.ones(B, np.int32), np.full(B, context, np.int32), indptr, ids, ps)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=B, max_num_pages=pages, buckets=(B,),
                                            max_pages_per_request=context // ps + 4))
    q = torch.randn(B, heads, CKV + ROPE, generator=gen, device="cuda").bfloat16()

    def attend(s, x, cache=cache):
        s.mark_stored(cache)  # (the cache is filled by hand)
        return mla.run(s, x["q"], cache)

    graphs = DecodeGraphs(pool, attend, {"q": torch.zeros_like(q)})
    graphs.capture()
    step = pool.commit(build_plan(batch, spec))
    ours = graphs(step, q=q).clone()
    ours_graph = graphs.graph_for(step)

    # the raw library call over the same cache and pages
    dev = {k: torch.as_tensor(v, device="cuda") for k, v in
           dict(qo=np.arange(B + 1, dtype=np.int32), kvp=indptr, kvi=ids, kvl=np.full(B, context, np.int32)).items()}
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, qo_indptr=dev["qo"].clone(), kv_indptr=dev["kvp"].clone(),
                                      kv_indices=dev["kvi"].clone(), kv_len_arr=dev["kvl"].clone())
    w.plan(metadata=MLAPlanMetadata.csr(dev["qo"].cpu(), dev["kvp"].cpu(), dev["kvi"], dev["kvl"].cpu()), num_heads=heads,
           head_dim_ckv=CKV, head_dim_kpe=ROPE, page_size=ps, causal=True, sm_scale=192**-0.5, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16, kv_cache_layout="split")
    P = cache.k.shape[0]
    kv = (cache.k.view(P, ps, CKV), cache.v.view(P, ps, ROPE))
    out = torch.empty(B, heads, CKV, device="cuda", dtype=torch.bfloat16)
    w.run(query=q, kv_cache=kv, out=out)
    raw_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(raw_graph):
        w.run(query=q, kv_cache=kv, out=out)
    raw_graph.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out, ours))
    t = interleaved_rounds({"ours": ours_graph.replay, "raw": raw_graph.replay})
    nbytes = B * context * (CKV + ROPE) * 2
    res = dict(heads=heads, batch=B, context=context, page_size=ps, bytes=nbytes, ours_equals_raw=same)
    for k, v in t.items():
        med = statistics.median(v)
        res[k] = dict(us=med, rounds=v, gbs=nbytes / (med * 1e-6) / 1e9)
    del pool, graphs, cache, w, ws, attend
    torch.cuda.empty_cache()
    return res


def markdown(r: dict) -> str:
    lines = ["# Latent attention (MLA) decode, H100", "",
             f"`python -m benchmarks.mla_decode OUT`; {r['device']}, FlashInfer {r['flashinfer']}; c_kv 512 + k_pe 64, bf16, "
             f"page {r['cases'][0]['page_size']}, every request exactly `context` tokens on random pages. Ours: backend "
             "'flashinfer_mla' replayed from DecodeGraphs; raw: FlashInfer's BatchMLAPagedAttentionWrapper planned and "
             "captured by hand over the same cache. Medians of 5 rounds x 50 replays (spread: min-max of the round "
             f"medians). Bytes: the cache read once. Copy ceiling (2 GiB device-to-device, read + write): {r['copy_gbs']:.0f} GB/s.",
             "", "| heads | B | context | ours µs | raw µs | ours / raw | GB/s (% of copy), ours | output equal to raw |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in r["cases"]:
        o, w = c["ours"], c["raw"]
        lines.append(f"| {c['heads']} | {c['batch']} | {c['context']} | {median_spread(o['rounds'])} "
                     f"| {median_spread(w['rounds'])} | {o['us'] / w['us']:.3f} "
                     f"| {o['gbs']:.0f} ({o['gbs'] / r['copy_gbs']:.0%}) | {c['ours_equals_raw']} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    from benchmarks.fp8_decode import copy_ceiling_gbs

    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "copy_gbs": copy_ceiling_gbs(), "cases": []}
    for heads, B, ctx in CASES:
        r["cases"].append(run_case(heads, B, ctx))
        json.dump(r, open(f"{out_dir}/mla_decode_h100.json", "w"), indent=1)
        print(markdown(r), flush=True)
    open(f"{out_dir}/mla_decode_h100.md", "w").write(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
