"""H100: token-tree verify against chain verify of the same token count, FlashInfer, side by side in one run.

Llama-3-8B-like attention (32 / 8 heads, d 128, bf16, page 16); B = 1, 8, 64 requests of `context` (4,096)
tokens after the step, the same pages, cache contents and queries in both arms:
- 64 tokens per request: a random tree (kernels/_flashinfer_tree.py's eager path: the prefix through
  FlashInfer's paged prefill as `auto` picks it, the tree part through its FA2 ragged prefill with the mask,
  merged) against a chain of 64 (a causal extend step: FlashInfer's paged prefill as
  `auto` picks it), one layer's `run` timed eagerly, and the same `run` of each arm captured whole into a
  CUDA graph by the benchmark and replayed (device time, no host issue: the steps stay planned);
- 16 tokens per request: a random tree (bucketed: the graph-mode wrappers, the prefix on FA2 as the chain's
  verify, replayed from its captured graph) against a chain of 16 (a verify step: FlashInfer's multi-token decode, replayed).
CUDA-event medians of 50 calls, 5 interleaved rounds per arm; each arm's commit (host µs, the mask built on the
device included; median of 20, the device drained between) beside it.
Run on the GPU: python -m benchmarks.tree_verify OUT_DIR   (writes tree_verify_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from mstar_attn import AttentionSpec, DraftTree, PagedKVCache, PoolLimits, StepBatch, build_plan, build_tree_plan, run
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.tuning import interleaved_rounds, median_spread

PS, H, KVH, D = 16, 32, 8, 128
BATCHES, CONTEXT = (1, 8, 64), 4096


def random_tree(rng: np.random.Generator, n: int) -> list[int]:
    """An EAGLE-like tree of n tokens: each token's parent among the earlier ones, biased to the recent."""
    return [-1] + [int(j - 1 - min(rng.geometric(0.5) - 1, j - 1)) for j in range(1, n)]


def commit_us(pool: GraphBufferPool, plan) -> float:
    """Median host µs of pool.commit(plan) (20 commits, the device drained between)."""
    ts = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool.commit(plan)
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def run_case(B: int, n: int, rng: np.random.Generator) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(B * 100 + n)
    per = CONTEXT // PS
    pages = B * per + 8
    spec = AttentionSpec(H, KVH, D, PS, pages)
    kv = [torch.randn(pages + 1, PS, KVH, D, generator=gen, device="cuda").bfloat16() for _ in range(2)]
    cache = PagedKVCache.from_tensors(*kv)
    ids = rng.permutation(pages)[: B * per].astype(np.int32)
    batch = StepBatch.from_csr(np.full(B, n, np.int32), np.full(B, CONTEXT, np.int32),
                               np.arange(B + 1, dtype=np.int32) * per, ids, PS)
    plans = {"chain": build_plan(batch, spec),
             "tree": build_tree_plan(batch, spec, DraftTree.from_parents([random_tree(rng, n) for _ in range(B)]))}
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=64 * 64, max_num_pages=pages,
                                            buckets=(1, 8, 64), max_pages_per_request=per + 8))
    q = torch.randn(B * n, H, D, generator=gen, device="cuda").bfloat16()
    graphs = None
    if n <= 16:
        def attend(step, x):
            step.mark_stored(cache)  # (timing: the cache is filled by hand)
            return run(step, x["q"], cache)
        graphs = DecodeGraphs(pool, attend, {"q": torch.zeros(64 * n, H, D, device="cuda", dtype=torch.bfloat16)})
        graphs.capture(q_lens=(n,), trees=True)
    commits = {arm: commit_us(pool, plan) for arm, plan in plans.items()}
    calls, outs, keep = {}, {}, []
    for arm, plan in plans.items():
        step = pool.commit(plan, slot=0 if arm == "chain" else 1)  # (each arm's step live in a slot of its own)
        step.mark_stored(cache)
        if graphs is not None:
            assert graphs.serves(step), (arm, B, n)
            outs[arm] = graphs(step, q=q).clone()
            calls[arm] = graphs.graph_for(step).replay
        else:
            outs[arm] = run(step, q, cache).clone()
            calls[arm] = (lambda s: lambda: run(s, q, cache))(step)
        keep.append(step)
    if graphs is None:  # the same eager runs, each captured whole into a graph of the benchmark's: device time
        try:
            for arm in plans:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run(keep[0 if arm == "chain" else 1], q, cache)
                calls[f"{arm} captured"] = g.replay
                keep.append(g)
        except RuntimeError as e:  # (reported, and the eager rows kept)
            print(f"B={B} n={n}: capture failed: {e}")
            calls = {arm: calls[arm] for arm in plans}
    t = interleaved_rounds(calls)
    diff = (outs["tree"].float() - outs["chain"].float()).norm() / outs["chain"].float().norm()
    res = dict(batch=B, tokens=n, context=CONTEXT, replayed=graphs is not None, chain_rounds=t["chain"],
               tree_rounds=t["tree"], ratio=statistics.median(t["tree"]) / statistics.median(t["chain"]),
               chain_commit_us=commits["chain"], tree_commit_us=commits["tree"], output_change=float(diff))
    if "tree captured" in t:
        res.update(chain_captured_rounds=t["chain captured"], tree_captured_rounds=t["tree captured"],
                   captured_ratio=statistics.median(t["tree captured"]) / statistics.median(t["chain captured"]))
    return res


def markdown(r: dict) -> str:
    lines = ["# Token-tree verify vs chain verify of the same token count, FlashInfer, H100", "",
             f"`python -m benchmarks.tree_verify OUT`; {r['device']}, FlashInfer {r['flashinfer']}; one layer, {H}/{KVH} "
             f"heads, d {D}, bf16, page {PS}, every request {CONTEXT} tokens after the step. 64 tokens: eager `run` "
             "(tree: the prefix, FlashInfer's pick, and the masked tree part, FA2 ragged, merged; chain: a causal "
             "extend step, FlashInfer's pick); 16 tokens: replayed graphs (tree: the graph-mode prefix, FA2, and "
             "tree part, merged; chain: the multi-token decode); rows 'captured': the 64-token arms' eager `run` "
             "captured whole into a graph by the benchmark, replayed (device time at equal work). "
             "Medians of 5 interleaved rounds x 50 calls (spread: min-max of the round medians); commit: host µs "
             "per commit, the device mask build included. Output change: ||tree - chain|| / ||chain|| (the masks "
             "differ).", "",
             "| B | tokens | graphs | chain µs | tree µs | tree / chain | chain commit µs | tree commit µs | output change |",
             "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["cases"]:
        lines.append(f"| {x['batch']} | {x['tokens']} | {'yes' if x['replayed'] else 'no'} | "
                     f"{median_spread(x['chain_rounds'])} | {median_spread(x['tree_rounds'])} | {x['ratio']:.2f} | "
                     f"{x['chain_commit_us']:.0f} | {x['tree_commit_us']:.0f} | {x['output_change']:.3f} |")
        if "captured_ratio" in x:
            lines.append(f"| {x['batch']} | {x['tokens']} | captured | {median_spread(x['chain_captured_rounds'])} | "
                         f"{median_spread(x['tree_captured_rounds'])} | {x['captured_ratio']:.2f} | | | |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    rng = np.random.default_rng(0)
    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
         "cases": []}
    for n in (64, 16):
        for B in BATCHES:
            r["cases"].append(run_case(B, n, rng))
            torch.cuda.empty_cache()  # (the case's cache and pool are gone)
    json.dump(r, open(f"{out_dir}/tree_verify_h100.json", "w"), indent=1)
    open(f"{out_dir}/tree_verify_h100.md", "w").write(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
