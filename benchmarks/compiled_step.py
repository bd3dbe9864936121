"""H100: a 1B-class Llama step, uncompiled eager vs torch.compile full graph vs piecewise, µs per step.

A random transformers Llama (16 layers, hidden 2048, 32 / 8 heads, d 64, vocab 8192, bf16) served through
mstar_attn.Attention on FlashInfer, one pool (page 16). Two steps, committed once and run again and again
(each run stores the same K/V):
- decode: B = 32 requests of ~1,024 tokens. Arms: eager (the layers' direct calls), full (the compiled forward,
  attention as custom ops, run eagerly), full + graph (that forward captured whole per bucket by DecodeGraphs
  and replayed), piecewise (compile_piecewise, the inputs padded to the bucket's rows: the pieces between the
  attention calls replay CUDA graphs).
- mixed: 30 decodes of ~1,024 tokens beside 2 prompt chunks of 256 new tokens (542 tokens). Arms: eager, full,
  piecewise (padded to a multiple of 64 rows: 576).
CUDA-event medians of 20 forwards, 5 interleaved rounds per arm (spread: min-max of the round medians); the
outputs of every arm against eager's, per request (norm-relative).
Run on the GPU: python -m benchmarks.compiled_step OUT_DIR   (writes compiled_step_h100.json / .md)
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from mstar_attn import Attention, AttentionSpec, PagedKVCache, PoolLimits, StepBatch, build_plan, step_context
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.demo import llama
from mstar_attn.demo.config import DemoConfig
from mstar_attn.piecewise import STATS, compile_piecewise
from mstar_attn.tuning import interleaved_rounds, median_spread

PS, LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 16, 16, 2048, 32, 8, 8192
CONTEXT, DECODES, PROMPTS, CHUNK = 1024, 32, 2, 256


def _batch(rng, q_lens: list[int], kv_lens: list[int], num_pages: int) -> StepBatch:
    need = [-(-k // PS) for k in kv_lens]
    ids = rng.permutation(num_pages)[: sum(need)].astype(np.int32)
    return StepBatch.from_pages(q_lens, kv_lens, np.split(ids, np.cumsum(need)[:-1]), PS)


def _errors(out: torch.Tensor, want: torch.Tensor, plan) -> float:
    """The largest per-request norm-relative difference over the step's rows."""
    worst = 0.0
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        o, w = out[a:b].float(), want[a:b].float()
        worst = max(worst, ((o - w).norm() / w.norm()).item())
    return worst


def main(out_dir: str) -> None:
    import flashinfer

    rng = np.random.default_rng(0)
    device = torch.device("cuda")
    cfg = DemoConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB, seed=0, init_std=0.02)
    model = llama.build_model(cfg, torch.bfloat16, device)
    num_pages = (DECODES + PROMPTS + 2) * (CONTEXT // PS + 4)
    spec = AttentionSpec(HEADS, KV_HEADS, HIDDEN // HEADS, PS, num_pages, layer_groups=(0,) * LAYERS)
    layers = [Attention(spec, i, PagedKVCache.allocate(spec, device)) for i in range(LAYERS)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for a in layers:
        for t in (a.cache.k, a.cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=1024, max_num_pages=num_pages,
                                            max_pages_per_request=CONTEXT // PS + 8))
    full = torch.compile(llama.forward, fullgraph=True)
    piecewise = compile_piecewise(llama.forward)

    def compiled(fn, ctx, ids, positions, padded=None):
        with step_context(ctx, padded_rows=padded):
            return fn(model, None, layers, ids, positions)

    graphs = DecodeGraphs(pool, lambda ctx, x: compiled(full, ctx, x["ids"], x["positions"]),
                          {n: torch.zeros(64, dtype=torch.int64, device=device) for n in ("ids", "positions")})
    graphs.capture(buckets=(DECODES,))  # (before the steps' commits: capture commits scratch steps into every slot)
    lens = rng.integers(CONTEXT - 64, CONTEXT + 1, DECODES + PROMPTS).tolist()
    steps = {
        "decode": build_plan(_batch(rng, [1] * DECODES, lens[:DECODES], num_pages), spec),
        "mixed": build_plan(_batch(rng, [1] * (DECODES - 2) + [CHUNK] * PROMPTS,
                                   lens[: DECODES - 2] + [CHUNK] * PROMPTS, num_pages), spec),
    }
    out = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "torch": torch.__version__,
           "shape": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                         vocab=VOCAB), "steps": {}}
    for s, (name, plan) in enumerate(steps.items()):
        step = pool.commit(plan, slot=s)
        T = plan.num_tokens
        rows = step.padded_num_tokens
        n = rows if name == "decode" else -(-T // 64) * 64
        ids = torch.randint(0, VOCAB, (n,), device=device)
        positions = torch.cat([torch.from_numpy(plan.positions).to(device), torch.zeros(n - T, dtype=torch.int64,
                                                                                       device=device)])
        arms = {
            "eager": lambda: llama.forward(model, step, layers, ids[:rows], positions[:rows]),
            "full": lambda: compiled(full, step, ids[:rows], positions[:rows]),
            "piecewise": lambda: compiled(piecewise, step, ids, positions, padded=n),
        }
        if name == "decode":
            arms["full + graph"] = lambda: graphs(step, ids=ids[:rows], positions=positions[:rows])
        want = arms["eager"]()[:T].clone()
        errs = {arm: _errors(fn()[:T], want, plan) for arm, fn in arms.items()}  # (also compiles, captures)
        before = dict(STATS)
        t = interleaved_rounds(arms, rounds=5, n=20)
        out["steps"][name] = dict(tokens=T, padded_rows=n, arms={arm: dict(us=r, max_err=errs[arm])
                                                                 for arm, r in t.items()},
                                  piece_replays=STATS["replayed"] - before["replayed"])
    json.dump(out, open(f"{out_dir}/compiled_step_h100.json", "w"), indent=1)
    open(f"{out_dir}/compiled_step_h100.md", "w").write(markdown(out))
    print(markdown(out))


def markdown(r: dict) -> str:
    s = r["shape"]
    lines = ["# A 1B-class Llama step: eager vs compiled (full, piecewise), H100", "",
             f"`python -m benchmarks.compiled_step OUT`; {r['device']}, FlashInfer {r['flashinfer']}, torch {r['torch']}; "
             f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']}/{s['kv_heads']} heads, d {s['head_dim']}, vocab "
             f"{s['vocab']}, bf16, page {PS}. µs per forward (the step committed once), medians of 5 interleaved rounds "
             "x 20 (spread: min-max of the round medians); max err: the largest per-request norm-relative difference "
             "from eager.", "",
             "| step | tokens (padded) | arm | µs per step | max err |", "|---|---:|---|---:|---:|"]
    for name, x in r["steps"].items():
        for arm, a in x["arms"].items():
            lines.append(f"| {name} | {x['tokens']} ({x['padded_rows']}) | {arm} | {median_spread(a['us'])} | "
                         f"{a['max_err']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with torch.inference_mode():  # (serving: no autograd graphs in the eager arm, inference graphs compiled)
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
