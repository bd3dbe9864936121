"""H100: which FlashInfer kernel serves decode over an FP8 (e4m3) KV cache fastest, and how exact is it?

Side by side in one run, raw library calls (no pool), each captured in a CUDA graph and replayed:
  fi_tc    FlashInfer batch decode on tensor cores (its prefill kernels, FA2), bf16 q
  fi_cc    FlashInfer batch decode on CUDA cores, bf16 q
  xqa      FlashInfer's XQA decode kernel, generic path: bf16 q, FP8 K/V widened to bf16 in registers
  xqa_f8   XQA's Hopper FP8 kernel: q and the probabilities are rounded to e4m3 for FP8 tensor-core math
each over a bf16 cache and an FP8 cache (xqa_f8 only over FP8). 32/8 heads, d 128, page 16, random pages.
Error: per request, max |out - ref| / max |ref| against float32 attention over the same (dequantized) cache.
Run on the GPU: python -m benchmarks.fp8_kernels OUT_DIR   (writes fp8_kernels_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from mstar_attn.tuning import interleaved_rounds, median_spread

PS, H, KVH, D = 16, 32, 8, 128
K_SCALE, V_SCALE = 0.02, 0.015


def make_case(B: int, ctx: int, gen):
    n_pages = B * ctx // PS
    pages = torch.randperm(n_pages + 64, generator=gen, device="cuda")[:n_pages].int()
    table = pages.view(B, ctx // PS).contiguous()
    k = torch.randn(n_pages + 64, PS, KVH, D, generator=gen, device="cuda")
    v = torch.randn(n_pages + 64, PS, KVH, D, generator=gen, device="cuda")
    bf16 = (k.bfloat16(), v.bfloat16())
    fp8 = ((k / K_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn), (v / V_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn))
    del k, v
    q = torch.randn(B, H, D, generator=gen, device="cuda").bfloat16()
    return q, table, bf16, fp8


def reference(q, table, kc, vc, ks, vs) -> torch.Tensor:
    """float32 attention per request over the dequantized pages: [B, H, D]."""
    outs = []
    for b in range(q.shape[0]):
        k = kc[table[b].long()].float().reshape(-1, KVH, D) * ks
        v = vc[table[b].long()].float().reshape(-1, KVH, D) * vs
        qb = q[b].float().view(KVH, H // KVH, D)
        s = torch.einsum("hgd,nhd->hgn", qb, k) / D**0.5
        outs.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(H, D))
    return torch.stack(outs)


def variants(q, table, cache, fp8: bool):
    import flashinfer
    from flashinfer.xqa import get_xqa_module

    B, ctx_pages = table.shape
    ks, vs = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    indptr = torch.arange(B + 1, device="cuda", dtype=torch.int32) * ctx_pages
    last = torch.full((B,), PS, device="cuda", dtype=torch.int32)
    out = {}
    for name, tc in (("fi_tc", True), ("fi_cc", False)):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                                                          paged_kv_indptr_buffer=indptr.clone(),
                                                          paged_kv_indices_buffer=table.flatten().clone(),
                                                          paged_kv_last_page_len_buffer=last.clone())
        w.plan(indptr, table.flatten(), last, H, KVH, D, PS, q_data_type=torch.bfloat16,
               kv_data_type=cache[0].dtype)
        o = torch.empty_like(q)
        kw = dict(k_scale=ks, v_scale=vs) if fp8 else {}
        out[name] = (lambda w=w, o=o, kw=kw: w.run(q, cache, out=o, **kw), o, (w, ws))
    seq = torch.full((B, 1), ctx_pages * PS, device="cuda", dtype=torch.int32).view(torch.uint32)
    mod = get_xqa_module(torch.bfloat16, cache[0].dtype, PS, D, H // KVH, False, torch.bfloat16, 1)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    q_scale = D**-0.5 * ks / vs * D**0.5  # XQA: logits = q_scale * kv_scale * q.k / sqrt(d), output = kv_scale * p.v
    for name, sm90 in (("xqa", False), ("xqa_f8", True)):
        if sm90 and not fp8:
            continue
        o = torch.empty_like(q)
        o4, q4 = o.view(B, 1, H, D), q.view(B, 1, H, D)

        def call(o4=o4, q4=q4, sm90=sm90, ws=ws):
            mod.xqa(sm90, sm, KVH, 0, q_scale, o4, 1.0, q4, None, cache[0], cache[1], None, None, table,
                    ctx_pages * PS, seq, B, vs, ws[: 8 << 20].view(torch.uint32), ws[8 << 20:], True, 1, None, None)
        out[name] = (call, o, ws)
    return out


def run_case(B: int, ctx: int, rounds: int = 5, reps: int = 50) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1000 + B)
    q, table, bf16, fp8 = make_case(B, ctx, gen)
    graphs, errs = {}, {}
    for fmt, cache, (ks, vs) in (("bf16", bf16, (1.0, 1.0)), ("fp8", fp8, (K_SCALE, V_SCALE))):
        ref = reference(q, table, *cache, ks, vs)
        for name, (fn, o, keep) in variants(q, table, cache, fmt == "fp8").items():
            o.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((o.float() - ref).abs().amax((1, 2)) / ref.abs().amax((1, 2))).tolist()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            replay_err = (o.float() - ref).abs().amax().item()
            graphs[f"{name}/{fmt}"] = (g, keep, fn)
            errs[f"{name}/{fmt}"] = dict(max_rel_err=max(err), median_rel_err=statistics.median(err),
                                         replay_finite=bool(torch.isfinite(o).all()), replay_max_abs_err=replay_err)
    times = interleaved_rounds({k: g.replay for k, (g, _, _) in graphs.items()}, rounds, reps)
    res = dict(batch=B, context=ctx, variants={})
    base = statistics.median(times["fi_tc/bf16"])
    for k in graphs:
        med = statistics.median(times[k])
        nbytes = B * ctx * KVH * D * 2 * (1 if k.endswith("fp8") else 2)
        res["variants"][k] = dict(us=med, rounds=times[k], gbs=nbytes / (med * 1e-6) / 1e9,
                                  vs_fi_tc_bf16=base / med, **errs[k])
    del graphs
    torch.cuda.empty_cache()
    return res


def markdown(r: dict) -> str:
    lines = ["# FP8 KV decode kernels, H100", "", f"`python -m benchmarks.fp8_kernels OUT`; {r['device']}, FlashInfer "
             f"{r['flashinfer']}; raw library calls replayed from CUDA graphs, 32/8 heads, d 128, page 16, random pages, "
             f"medians of 5 rounds x 50 replays (spread: min-max of the round medians). Copy ceiling {r['copy_gbs']:.0f} GB/s "
             "(read + write). Error: the worst request's max |out - ref| / max |ref| against float32 attention over the "
             "same (dequantized) cache.", "",
             "| B | context | kernel / cache | µs (spread) | speedup vs fi_tc bf16 | GB/s (% of copy) | worst rel. error |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for c in r["cases"]:
        for k, v in c["variants"].items():
            lines.append(f"| {c['batch']} | {c['context']} | {k} | {median_spread(v['rounds'])} "
                         f"| {v['vs_fi_tc_bf16']:.2f}x | {v['gbs']:.0f} ({v['gbs'] / r['copy_gbs']:.0%}) | {v['max_rel_err']:.2e} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    from benchmarks.fp8_decode import copy_ceiling_gbs

    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "copy_gbs": copy_ceiling_gbs(), "cases": []}
    for B, ctx in ((64, 4096), (16, 4096), (256, 2048)):
        r["cases"].append(run_case(B, ctx))
        json.dump(r, open(f"{out_dir}/fp8_kernels_h100.json", "w"), indent=1)
        print(markdown(r), flush=True)
    open(f"{out_dir}/fp8_kernels_h100.md", "w").write(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
