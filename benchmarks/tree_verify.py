"""H100: token-tree verify against chain verify of the same token count, FlashInfer, side by side in one run.

Llama-3-8B-like attention (32 / 8 heads, d 128, bf16, page 16); B = 1, 8, 64 requests of `context` (4,096)
tokens after the step, the same pages, cache contents and queries in both arms:
- 64 tokens per request: a random tree (bucketed by a pool of max_tree_nodes=64: the prefix through
  FlashInfer's graph-mode FA2 paged prefill, the tree part through its FA2 ragged prefill with the mask on a side
  stream, merged; replayed from the pool's graph) against a chain of 64 (a causal extend step, FlashInfer's paged
  prefill as `auto` picks it; unbucketed: its eager `run` captured whole into a graph by the benchmark);
- 16 tokens per request: a random tree against a chain of 16 (a verify step: FlashInfer's multi-token
  decode), both replayed from the pool's graphs.
Each arm also called eagerly (host issue included). CUDA-event medians of 50 calls, 5 interleaved rounds per
arm; each arm's commit (host µs, the mask built on the device included; median of 20, the device drained
between) beside it.
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
                                            buckets=(1, 8, 64), max_pages_per_request=per + 8, max_tree_nodes=64))
    q = torch.randn(B * n, H, D, generator=gen, device="cuda").bfloat16()

    def attend(step, x):
        step.mark_stored(cache)  # (timing: the cache is filled by hand)
        return run(step, x["q"], cache)
    graphs = DecodeGraphs(pool, attend, {"q": torch.zeros(64 * n, H, D, device="cuda", dtype=torch.bfloat16)})
    graphs.capture(q_lens=(n,), trees=True)  # (past 16 tokens: the tree steps' graphs only)
    commits = {arm: commit_us(pool, plan) for arm, plan in plans.items()}
    calls, outs, keep, how = {}, {}, [], {}
    for arm, plan in plans.items():
        step = pool.commit(plan, slot=0 if arm == "chain" else 1)  # (each arm's step live in a slot of its own)
        step.mark_stored(cache)
        outs[arm] = run(step, q, cache).clone()
        calls[arm] = (lambda s: lambda: run(s, q, cache))(step)
        if graphs.serves(step):  # the pool's own graph
            again = graphs(step, q=q).float()
            assert (again - outs[arm].float()).norm() <= 1e-2 * outs[arm].float().norm(), (arm, B, n)
            calls[f"{arm} graph"], how[arm] = graphs.graph_for(step).replay, "pool graph"
        else:  # (a chain past 16 tokens is an extend step: its eager run captured whole by the benchmark)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(step, q, cache)
            calls[f"{arm} graph"], how[arm] = g.replay, "captured run"
            keep.append(g)
        keep.append(step)
    t = interleaved_rounds(calls)
    med = {k: statistics.median(v) for k, v in t.items()}
    diff = (outs["tree"].float() - outs["chain"].float()).norm() / outs["chain"].float().norm()
    return dict(batch=B, tokens=n, context=CONTEXT, rounds=t, chain_graph=how["chain"], tree_graph=how["tree"],
                ratio=med["tree"] / med["chain"], graph_ratio=med["tree graph"] / med["chain graph"],
                chain_commit_us=commits["chain"], tree_commit_us=commits["tree"], output_change=float(diff))


def markdown(r: dict) -> str:
    lines = ["# Token-tree verify vs chain verify of the same token count, FlashInfer, H100", "",
             f"`python -m benchmarks.tree_verify OUT`; {r['device']}, FlashInfer {r['flashinfer']}; one layer, {H}/{KVH} "
             f"heads, d {D}, bf16, page {PS}, every request {CONTEXT} tokens after the step; a random tree vs a chain "
             "of the same token count, the same pages, cache and queries. Device time: each arm replayed from a "
             "CUDA graph, the pool's own (`DecodeGraphs.capture(q_lens=(n,), trees=True)`, a pool of "
             "`max_tree_nodes=64`) where it buckets the step, else ('captured run') the eager `run` captured whole "
             "by the benchmark (a chain of 64 is an extend step: no pool graph). Eager: `run` called from Python "
             "(host issue included). Medians of 5 interleaved rounds x 50 calls (spread: min-max of the round "
             "medians); commit: host µs per commit, the device mask build included. Output change: "
             "||tree - chain|| / ||chain|| (the masks differ).", "",
             "| B | tokens | chain graph µs | tree graph µs | **tree / chain (graphs)** | chain eager µs | tree eager µs "
             "| tree / chain (eager) | chain commit µs | tree commit µs | output change |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["cases"]:
        t = x["rounds"]
        lines.append(f"| {x['batch']} | {x['tokens']} | {median_spread(t['chain graph'])} ({x['chain_graph']}) | "
                     f"{median_spread(t['tree graph'])} ({x['tree_graph']}) | **{x['graph_ratio']:.2f}** | "
                     f"{median_spread(t['chain'])} | {median_spread(t['tree'])} | {x['ratio']:.2f} | "
                     f"{x['chain_commit_us']:.0f} | {x['tree_commit_us']:.0f} | {x['output_change']:.3f} |")
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
