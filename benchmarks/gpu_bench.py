"""H100 benchmarks of the FlashInfer path, side by side with the raw FlashInfer wrapper, one process.

(a) host time per decode step: build_plan + commit (FlashInfer scheduling included) vs the
    raw wrapper.plan() on the same inputs; (b) kernel time through mstar_attn, eager and
    replayed, vs the raw wrapper on the same inputs (eager vs its eager wrapper, replayed vs
    its CUDA-graph-mode wrapper replayed): decode, verify, paged prefill; (c) decode bandwidth
    vs measured copy bandwidth.
Run on the GPU: python -m benchmarks.gpu_bench OUT_DIR   (writes flashinfer_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch

from benchmarks import cases
from mstar_attn import PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES, GraphBufferPool
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.tuning import copy_TBps, event_median_us, host_median_us

import flashinfer  # noqa: E402

DEV = "cuda"


def host_median(fn, n=300, warmup=30):
    return host_median_us(fn, n, warmup, sync_every=50)


def gpu_median(fn, n=50, warmup=5):
    for _ in range(warmup - 1):
        fn()
    return event_median_us(fn, n)  # one more warm-up call, then n timed


def copy_bandwidth():
    return copy_TBps(n=20)


def raw_decode_wrapper(ws, plan, spec, q_len=1, graph=False):
    """FlashInfer's own decode wrapper on the plan's inputs (host indptr / last_page_len, device
    indices), eager or in its CUDA-graph mode on buffers of its own; returns (wrapper, plan())."""
    args = (torch.from_numpy(plan.kv_indptr.copy()), torch.from_numpy(plan.kv_indices.copy()).to(DEV),
            torch.from_numpy(plan.kv_last_page_len.copy()))
    bufs = {}
    if graph:
        bufs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=args[0].to(DEV), paged_kv_indices_buffer=args[1].clone(),
                    paged_kv_last_page_len_buffer=args[2].to(DEV))
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=spec.gqa_group >= 4 or q_len > 1, **bufs)
    kw = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.sm_scale, q_len_per_req=q_len)
    do_plan = lambda: w.plan(*args, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, **kw)  # noqa: E731
    do_plan()
    return w, do_plan


def profile_commit(pool, plan, out_dir: str) -> None:
    """Where commit's host time goes (cProfile, B=256), for the notes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        pool.commit(plan)
    prof.disable()
    torch.cuda.synchronize()
    with open(f"{out_dir}/commit_profile.txt", "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    spec = cases.spec()
    results = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "torch": torch.__version__}
    cache = PagedKVCache.allocate(spec, DEV)  # + the scratch page
    for t in (cache.k, cache.v):
        t.normal_()
    ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=32768,
                                            max_num_pages=cases.NUM_PAGES - 256))
    for name, k in (("fast_replan", pool.backend_state("flashinfer").use_fast),):
        results[name] = k

    # (a) host time per decode step
    host = []
    for B in (1, 64, 256):
        batch = cases.decode(B)
        plan = build_plan(batch, spec)
        _, raw_plan = raw_decode_wrapper(ws, plan, spec)
        raw = host_median(raw_plan)
        ours = host_median(lambda: pool.commit(build_plan(batch, spec)))
        ours_trusted = host_median(lambda: pool.commit(build_plan(batch, spec, check_ownership=False)))
        plan_only = host_median(lambda: build_plan(batch, spec))
        commit_only = host_median(lambda: pool.commit(plan))
        step = pool.commit(plan)  # FlashInfer's C++ planner alone, as commit calls it (the floor of any commit)
        fast, dg = pool.backend_state("flashinfer").fast[(step.slot, 0, step.padded_batch_size, 1)], step.groups[0]
        planner_only = host_median(lambda: fast.replan(step.host_qo_indptr, dg.host_kv_indptr, dg.host_kv_lens))
        raw2 = host_median(raw_plan)
        host.append(dict(batch=B, build_plan_us=plan_only, commit_us=commit_only, cpp_planner_us=planner_only, ours_us=ours,
                         ours_no_ownership_scan_us=ours_trusted, flashinfer_plan_us=(raw + raw2) / 2,
                         flashinfer_plan_spread_us=abs(raw - raw2), ratio=ours / ((raw + raw2) / 2),
                         ratio_no_ownership_scan=ours_trusted / ((raw + raw2) / 2)))
    results["host_decode_step"] = host
    profile_commit(pool, build_plan(cases.decode(256), spec), out_dir)

    # (b) + (c) kernel time: decode at 4096 tokens, verify, prefill 8 x 4096 causal
    kernel = []

    def attend(s, x):
        s.mark_stored(cache)  # (capture's scratch steps too)
        return fi.run(s, x["q"], cache)

    copy_tbs = copy_bandwidth()
    results["copy_TBps"] = copy_tbs
    for B, q_len in ((32, 1), (64, 1), (128, 1), (64, 4)):
        batch = cases.decode(B, context=4096, seed=1) if q_len == 1 else cases.verify(B, q_len, context=4096, seed=1)
        plan = build_plan(batch, spec)
        step = pool.commit(plan)
        step.mark_stored(cache)  # (timing: the cache is filled by hand)
        assert step.bucket == B and step.q_len == q_len
        q = torch.randn(B * q_len, 32, 128, device=DEV, dtype=torch.bfloat16)
        w, _ = raw_decode_wrapper(ws, plan, spec, q_len=q_len)
        raw_us = gpu_median(lambda: w.run(q, (cache.k, cache.v)))
        eager_us = gpu_median(lambda: fi.run(step, q, cache))
        static = torch.zeros(B * q_len, 32, 128, device=DEV, dtype=torch.bfloat16)
        graphs = DecodeGraphs(pool, attend, {"q": static})
        graphs.capture((B,), q_lens=(q_len,))
        step = pool.commit(plan)
        graphs(step, q=q)  # the live q now sits in the static input: time the replay alone, as for raw
        graph_us = gpu_median(graphs.graph_for(step).replay)
        wg, _ = raw_decode_wrapper(ws, plan, spec, q_len=q_len, graph=True)
        raw_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(raw_graph):
            wg.run(q, (cache.k, cache.v))
        raw_graph_us = gpu_median(raw_graph.replay)
        kv_bytes = int(plan.kv_lens.sum()) * 8 * 128 * 2 * 2
        kernel.append(dict(case=f"{'decode' if q_len == 1 else f'verify q_len={q_len}'} B={B} ~4096 tok", raw_us=raw_us,
                           raw_graph_us=raw_graph_us, ours_eager_us=eager_us, ours_graph_us=graph_us,
                           eager_vs_raw=eager_us / raw_us - 1, graph_vs_raw_graph=graph_us / raw_graph_us - 1,
                           TBps=kv_bytes / (graph_us * 1e-6) / 1e12, frac_of_copy=kv_bytes / (graph_us * 1e-6) / 1e12 / copy_tbs))
    # prefill 8 x 4096 causal through the paged prefill wrapper; raw with and without seq_lens
    n, L = 8, 4096
    kv = np.full(n, L, np.int32)
    need = (kv + 15) // 16
    indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
    batch = StepBatch.from_csr(kv, kv, indptr, np.random.default_rng(2).permutation(cases.NUM_PAGES)[: indptr[-1]], 16)
    plan = build_plan(batch, spec)
    step = pool.commit(plan)
    step.mark_stored(cache)
    q = torch.randn(n * L, 32, 128, device=DEV, dtype=torch.bfloat16)
    raws = {}
    for name, extra in (("raw", {}), ("raw_seq_lens", {"seq_lens": torch.from_numpy(plan.kv_lens.copy())})):
        raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        raw.plan(torch.from_numpy(plan.qo_indptr.copy()), torch.from_numpy(plan.kv_indptr.copy()),
                 torch.from_numpy(plan.kv_indices.copy()).to(DEV), torch.from_numpy(plan.kv_last_page_len.copy()),
                 32, 8, 128, 16, causal=True, q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.sm_scale, **extra)
        raws[name] = raw
    times = {k: [] for k in ("raw", "ours", "raw_seq_lens")}
    for _ in range(5):  # interleaved rounds: clocks drift over seconds, each round sees the same drift
        for name in times:
            fn = (lambda: fi.run(step, q, cache)) if name == "ours" else (lambda r=raws[name]: r.run(q, (cache.k, cache.v)))
            times[name].append(gpu_median(fn, n=15))
    raw_us, eager_us = statistics.median(times["raw"]), statistics.median(times["ours"])
    flops = 4 * n * L * L / 2 * 32 * 128
    kernel.append(dict(case="prefill 8 x 4096 causal (paged)", raw_us=raw_us, raw_seq_lens_us=statistics.median(times["raw_seq_lens"]),
                       ours_eager_us=eager_us, eager_vs_raw=eager_us / raw_us - 1, TFLOPs=flops / (eager_us * 1e-6) / 1e12,
                       all_runs=times, backends={k: getattr(r, "_backend", "?") for k, r in raws.items()} | {
                           "ours": getattr(step.scheduled[0], "_backend", "?")}))
    results["kernel"] = kernel

    json.dump(results, open(f"{out_dir}/flashinfer_h100.json", "w"), indent=1)
    md = [f"# FlashInfer path on {results['device']} (flashinfer {results['flashinfer']}, torch {results['torch']})", "",
          "## (a) Host time per decode step (median µs; 32/8 heads, d=128, page 16, ~2k tokens)", "",
          "| B | build_plan | commit | of which FlashInfer's C++ planner | build_plan + commit | same, no ownership scan | FlashInfer plan() | ours / plan() | no scan / plan() |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for h in host:
        md.append(f"| {h['batch']} | {h['build_plan_us']:.1f} | {h['commit_us']:.1f} | {h['cpp_planner_us']:.1f} | {h['ours_us']:.1f} | {h['ours_no_ownership_scan_us']:.1f} | "
                  f"{h['flashinfer_plan_us']:.1f} ± {h['flashinfer_plan_spread_us'] / 2:.1f} | {h['ratio']:.2f} | {h['ratio_no_ownership_scan']:.2f} |")
    md += ["", f"## (b, c) Kernel time (median µs, CUDA events); copy bandwidth {copy_tbs:.2f} TB/s (read + write)", "",
           "| case | raw wrapper | raw graph-mode wrapper, replayed | ours eager | ours replayed | eager vs raw | replayed vs raw replayed | TB/s (replayed) | of copy BW |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in kernel:
        md.append(f"| {k['case']} | {k['raw_us']:.1f} | {k.get('raw_graph_us', float('nan')):.1f} | {k['ours_eager_us']:.1f} | "
                  f"{k.get('ours_graph_us', float('nan')):.1f} | {k['eager_vs_raw']:+.1%} | {k.get('graph_vs_raw_graph', float('nan')):+.1%} | "
                  f"{k.get('TBps', float('nan')):.2f} | {k.get('frac_of_copy', float('nan')):.0%} |")
    open(f"{out_dir}/flashinfer_h100.md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
