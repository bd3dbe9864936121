"""H100: speculative draft rounds side by side with single decode steps, one process, both paged backends.

(a) host µs to plan + commit a K = 4 round (build_round + commit_round) vs one decode step of the
    same batch (build_plan + commit), interleaved rounds; B = 1, 8, 64, 256 at ~2k tokens, page
    16, 32/8 heads, d 128. Batches are made ahead (the engine's part, the same for both sides).
(b) a K = 4 round of a 4-layer attention stack (write_kv + run per layer and step) replayed as one
    graph after one round commit, vs 4 decode steps each committed and replayed (a graph each):
    wall µs per round (host + GPU, synchronised every round) and µs between CUDA events around
    it (the device timeline: host gaps the GPU waits through included).
(c) kernel time of one layer's verify step (q_len 5 = K + 1) vs a decode step at the same batch.
Run on the GPU: python -m benchmarks.draft_round OUT_DIR   (writes draft_round_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.timing import host_us, spread
from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs, RoundGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import flash_attn as fa, flashinfer as fi
from mstar_attn.metadata.draft import build_round
from mstar_attn.tuning import event_median_us

PS, K, LAYERS = 16, 4, 4
BACKENDS = {"flashinfer": fi, "flash_attn": fa}


def batches(B: int, context: int, rounds: int, seed: int) -> list[tuple[list[StepBatch], StepBatch]]:
    """([K decode steps], round) batches of `rounds` consecutive rounds (all K tokens kept): decode
    step j lists the pages of kv + j tokens, the round the pages of kv + K - 1; random distinct pages."""
    rng = np.random.default_rng(seed)
    kv = rng.integers(context - 256, context + 256, B).astype(np.int32)
    most = -(-(kv + K * rounds) // PS)
    pages = np.split(rng.permutation(B * (context // PS + 64))[: most.sum()].astype(np.int32), np.cumsum(most)[:-1])
    ones = np.ones(B, np.int32)
    out = []
    for r in range(rounds):
        now = kv + K * r
        steps = [StepBatch.from_pages(ones, now + j, [p[: -(-int(n + j) // PS)] for p, n in zip(pages, now)], PS)
                 for j in range(K)]
        out.append((steps, StepBatch.from_pages(ones, now, [p[: -(-(int(n) + K - 1) // PS)] for p, n in zip(pages, now)], PS)))
    return out


VARIANTS = (("flashinfer", True), ("flashinfer", False), ("flash_attn", None))  # (backend, FlashInfer draft_fixed)


def _pool(spec, fixed, **bounds):
    pool = GraphBufferPool(spec, PoolLimits(max_draft_steps=K, **bounds))
    if fixed is not None:
        pool.backend_state("flashinfer").draft_fixed = fixed
    return pool


def part_a() -> list[dict]:
    rows = []
    for name, fixed in VARIANTS:
        spec = AttentionSpec(32, 8, 128, PS, 1 << 16, backend=name)
        for B in (1, 8, 64, 256):
            pool = _pool(spec, fixed, max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages,
                         max_pages_per_request=256)
            work = batches(B, 2048, 8, B)
            it = {"i": 0}

            def one(kind):
                decs, ahead = work[it["i"] % len(work)]
                it["i"] += 1
                if kind == "round":
                    pool.commit_round(build_round(ahead, spec, K))
                else:
                    pool.commit(build_plan(decs[0], spec))

            t = {"decode_step": [], "round": []}
            for _ in range(3):  # interleaved: the host's noise hits both sides
                t["decode_step"] += host_us(lambda: one("decode"))
                t["round"] += host_us(lambda: one("round"))
            one("decode")
            step_bytes = pool.last_commit_bytes
            one("round")
            round_bytes = pool.last_commit_bytes
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append(dict(backend=name, draft_fixed=fixed, batch=B, decode_step_us=med["decode_step"], round_us=med["round"],
                             ratio=med["round"] / med["decode_step"], decode_iqr_us=spread(t["decode_step"]),
                             round_iqr_us=spread(t["round"]), decode_h2d_bytes=step_bytes, round_h2d_bytes=round_bytes))
            print(rows[-1], flush=True)
            del pool
    return rows


def part_b() -> list[dict]:
    out = []
    for name, fixed in VARIANTS:
        mod = BACKENDS[name]
        for B, ctx in ((1, 2048), (8, 2048), (64, 2048)):
            spec = AttentionSpec(32, 8, 128, PS, B * (ctx // PS + 80) + 64, backend=name)
            caches = []
            for _ in range(LAYERS):
                c = PagedKVCache.allocate(spec, "cuda")
                for t in (c.k, c.v):
                    t.normal_()
                caches.append(c)
            pool = _pool(spec, fixed, max_batch_size=B, max_num_tokens=B * 8, max_num_pages=spec.num_pages,
                         buckets=(B,), max_pages_per_request=ctx // PS + 80)

            def stack(step, h, k, v):
                for c in caches:
                    mod.write_kv(step, k, v, c)
                    h = mod.run(step, h, c)
                return h

            def round_fn(steps, x):  # the output of step j feeds step j + 1 (as a sampled token would)
                h = x["q"]
                for s in steps:
                    h = stack(s, h, x["k"], x["v"])
                return h

            static = {n: torch.zeros(B, hh, 128, device="cuda", dtype=torch.bfloat16) for n, hh in (("q", 32), ("k", 8), ("v", 8))}
            rg = RoundGraphs(pool, round_fn, static)
            rg.capture(K)
            dg = DecodeGraphs(pool, lambda s, x: stack(s, x["q"], x["k"], x["v"]), static)
            dg.capture()
            x = {n: torch.randn_like(t) for n, t in static.items()}
            work = batches(B, ctx, 8, B)
            it = {"i": 0}

            def one_round():
                _, ahead = work[it["i"] % len(work)]
                it["i"] += 1
                rg(pool.commit_round(build_round(ahead, spec, K)), **x)

            def separate():
                decs, _ = work[it["i"] % len(work)]
                it["i"] += 1
                h = x["q"]
                for dec in decs:
                    h = dg(pool.commit(build_plan(dec, spec)), q=h, k=x["k"], v=x["v"])

            def wall(fn, n=60):
                fn()
                torch.cuda.synchronize()
                ts = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    ts.append((time.perf_counter() - t0) * 1e6)
                return ts

            res = {"round_wall": [], "separate_wall": [], "round_gpu": [], "separate_gpu": []}
            for _ in range(3):
                res["round_wall"] += wall(one_round)
                res["separate_wall"] += wall(separate)
                res["round_gpu"].append(event_median_us(one_round, 20))
                res["separate_gpu"].append(event_median_us(separate, 20))
            med = {k: statistics.median(v) for k, v in res.items()}
            out.append(dict(backend=name, draft_fixed=fixed, batch=B, context=ctx, layers=LAYERS,
                            **{f"{k}_us": v for k, v in med.items()}, **{f"{k}_iqr_us": spread(v) for k, v in res.items()},
                            replays=rg.replays))
            print(out[-1], flush=True)
            del rg, dg, pool, caches
            torch.cuda.empty_cache()
    return out


def part_c() -> list[dict]:
    out = []
    for name, mod in BACKENDS.items():
        for B in (8, 64):
            spec = AttentionSpec(32, 8, 128, PS, B * (2048 // PS + 80) + 64, backend=name)
            cache = PagedKVCache.allocate(spec, "cuda")
            for t in (cache.k, cache.v):
                t.normal_()
            pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=B * 8,
                                                    max_num_pages=spec.num_pages, buckets=(B,),
                                                    max_pages_per_request=2048 // PS + 80))
            static = {"q": torch.randn(B * (K + 1), 32, 128, device="cuda", dtype=torch.bfloat16)}

            def attend(s, x, mod=mod, cache=cache):
                s.mark_stored(cache)  # (timing: the cache is filled by hand)
                return mod.run(s, x["q"], cache)

            graphs = DecodeGraphs(pool, attend, static)
            graphs.capture(q_lens=(1, K + 1))
            t = {}
            for q_len in (1, K + 1):
                rng = np.random.default_rng(q_len)
                kv = rng.integers(2048 - 256, 2048 + 256, B).astype(np.int32)
                need = -(-kv // PS)
                pages = np.split(rng.permutation(spec.num_pages)[: need.sum()].astype(np.int32), np.cumsum(need)[:-1])
                step = pool.commit(build_plan(StepBatch.from_pages(np.full(B, q_len, np.int32), kv, pages, PS), spec))
                graphs(step, q=static["q"][: B * q_len])
                g = graphs.graph_for(step)
                t[q_len] = [event_median_us(g.replay, 50) for _ in range(5)]
            med = {q: statistics.median(v) for q, v in t.items()}
            out.append(dict(backend=name, batch=B, context=2048, decode_us=med[1], verify_us=med[K + 1],
                            verify_q_len=K + 1, ratio=med[K + 1] / med[1], decode_rounds=t[1], verify_rounds=t[K + 1]))
            print(out[-1], flush=True)
            del graphs, pool, cache, attend
            torch.cuda.empty_cache()
    return out


def _name(x: dict) -> str:
    fixed = x.get("draft_fixed")
    return x["backend"] + ("" if fixed is None else " (draft steps planned once)" if fixed else " (draft steps replanned)")


def _table(title: str, columns: list[str], rows) -> list[str]:
    """A Markdown section: its title, then a table (first column left-aligned, the others right)."""
    return [title, "", "| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1),
            *("| " + " | ".join(cells) + " |" for cells in rows), ""]


def markdown(r: dict) -> str:
    lines = [f"# Draft rounds (H100): K = {K}, page {PS}, 32/8 heads, d 128, bf16", "",
             f"Measured with `python -m benchmarks.draft_round OUT`; {r['device']}, FlashInfer {r['flashinfer']}, torch {r['torch']}.", ""]
    if "host" in r:
        lines += _table("## (a) Host µs: plan + commit of a K = 4 round vs one decode step of the same batch",
                        ["backend", "B", "decode step µs (IQR)", "K = 4 round µs (IQR)", "round / step", "H2D bytes step",
                         "H2D bytes round"],
                        [[_name(x), str(x["batch"]), f"{x['decode_step_us']:.0f} ({x['decode_iqr_us']:.0f})",
                          f"{x['round_us']:.0f} ({x['round_iqr_us']:.0f})", f"{x['ratio']:.2f}", str(x["decode_h2d_bytes"]),
                          str(x["round_h2d_bytes"])] for x in r["host"]])
    if "replay" in r:
        lines += _table(f"## (b) A K = 4 round of {LAYERS} attention layers: one commit + one graph replay vs 4 commits + 4 replays",
                        ["backend", "B", "ctx", "round wall µs", "4 steps wall µs", "round event µs", "4 steps event µs"],
                        [[_name(x), str(x["batch"]), str(x["context"])] + [f"{x[k]:.0f}" for k in (
                            "round_wall_us", "separate_wall_us", "round_gpu_us", "separate_gpu_us")] for x in r["replay"]])
    if "verify" in r:
        lines += _table(f"## (c) One layer's kernel: verify (q_len {K + 1}) vs decode at the same batch, ~2k tokens, replayed",
                        ["backend", "B", "decode µs", "verify µs", "verify / decode"],
                        [[x["backend"], str(x["batch"]), f"{x['decode_us']:.1f}", f"{x['verify_us']:.1f}", f"{x['ratio']:.2f}"]
                         for x in r["verify"]])
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> None:
    import flashinfer

    torch.manual_seed(0)
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["a", "b", "c"]
    r = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "torch": torch.__version__}
    if "a" in parts:
        r["host"] = part_a()
    if "b" in parts:
        r["replay"] = part_b()
    if "c" in parts:
        r["verify"] = part_c()
    json.dump(r, open(f"{out_dir}/draft_round_h100.json", "w"), indent=1)
    open(f"{out_dir}/draft_round_h100.md", "w").write(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
