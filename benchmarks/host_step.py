"""H100: host work per decode step through the page table, side by side with FlashInfer plan(), one process.

(a) host µs per decode step at B = 1, 8, 64, 256 (~2k tokens, page 16, 32/8 heads, d 128): all
    the engine calls per step on the StepRows path (table.append for requests starting a page,
    StepRows, build_plan, commit: FlashInfer's planner included where it still runs), the StepBatch
    path, and FlashInfer's own plan() on the same lengths, interleaved; host-to-device bytes per step.
(b) kernel time of a replayed decode with a per-step split-KV plan vs the fixed schedule (planned
    once, split-KV off) on decode shapes B x context, interleaved rounds.
(c) exposed host time: a 32-layer decode-attention graph (write_kv + run per layer) replayed back to
    back, vs the same with the per-step table update + plan + commit before each replay.
Run on the GPU: python -m benchmarks.host_step OUT_DIR   (writes host_step_h100.json / .md)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks import cases
from mstar_attn import AttentionSpec, PagedKVCache, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES, GraphBufferPool
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.metadata.batch import StepRows
from mstar_attn.tuning import event_median_us

import flashinfer  # noqa: E402

PS = cases.PAGE


class Engine:
    """A decode batch of B requests on a table pool: each step every request gains a token, and the
    ones starting a page get one (table.append). step() is all the host work of one step."""

    def __init__(self, pool, B: int, context: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.pool, self.table = pool, pool.table
        self.rows = rng.permutation(pool.table.max_requests)[:B].astype(np.int32)
        self.kv = rng.integers(context - 256, context + 256, B).astype(np.int32)
        self.free = list(rng.permutation(pool.spec.num_pages).astype(np.int32))
        for r, k in zip(self.rows, self.kv):
            self.table.assign(int(r), [self.free.pop() for _ in range(-(-int(k) // PS))])
        self.kv -= 1  # the first step writes the last token of the context

    def step(self):
        self.kv += 1
        start = (self.kv % PS) == 1  # these requests' new token starts a page
        if start.any():
            rows = self.rows[start]
            self.table.append(rows, [self.free.pop() for _ in range(rows.shape[0])])
        return self.pool.commit(build_plan(StepRows.decode(self.rows, self.kv), self.pool.spec))

    def csr(self):
        pages = [self.table.pages(int(r))[: -(-int(k) // PS)] for r, k in zip(self.rows, self.kv)]
        return StepBatch.from_pages(np.ones(len(pages), np.int32), self.kv, pages, PS)


def host_us(fn, n=400, warmup=40, sync_every=50) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
        if i % sync_every == 0:
            torch.cuda.synchronize()
    return out


def spread(xs):
    q = np.percentile(xs, [25, 75])
    return float(q[1] - q[0])


def part_a(spec, ws) -> list[dict]:
    rows = []
    for B in (1, 8, 64, 256):
        pool = GraphBufferPool(spec, max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages,
                               max_requests=1024, max_pages_per_request=256)
        eng = Engine(pool, B, 2048, seed=B)
        for _ in range(3):  # each slot's first commit of the bucket captures its device graph
            eng.step()
        batch = eng.csr()
        plan = build_plan(batch, spec)
        args = (torch.from_numpy(plan.kv_indptr.copy()), torch.from_numpy(plan.kv_indices.copy()).to("cuda"),
                torch.from_numpy(plan.kv_last_page_len.copy()))
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        kw = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.sm_scale)
        raw_plan = lambda: raw.plan(*args, 32, 8, 128, PS, **kw)  # noqa: E731
        old_pool = GraphBufferPool(spec, max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages)
        old = lambda: old_pool.commit(build_plan(batch, spec))  # noqa: E731
        t = {"flashinfer_plan": [], "rows_step": [], "batch_step": []}
        for _ in range(3):  # interleaved rounds: the host's noise hits every side
            t["flashinfer_plan"] += host_us(raw_plan)
            t["rows_step"] += host_us(eng.step)
            t["batch_step"] += host_us(old)
        eng.step()
        rows_bytes = pool.last_commit_bytes
        old()
        med = {k: statistics.median(v) for k, v in t.items()}
        rows.append(dict(batch=B, **{f"{k}_us": v for k, v in med.items()}, **{f"{k}_iqr_us": spread(v) for k, v in t.items()},
                         ratio=med["rows_step"] / med["flashinfer_plan"], batch_ratio=med["batch_step"] / med["flashinfer_plan"],
                         rows_h2d_bytes=rows_bytes, batch_h2d_bytes=old_pool.last_commit_bytes,
                         planner_skipped=bool(pool.scheduler_for("flashinfer").fixed)))
        print(rows[-1], flush=True)
        del pool, old_pool
    return rows


def part_b(spec_for) -> list[dict]:
    out = []
    for heads in ((32, 8), (16, 2)):
        for B in (8, 32, 64, 128, 256):
            for ctx in (512, 4096, 16384):
                if B * ctx > 256 * 4096 * 2:
                    continue
                spec = spec_for(heads, B * (ctx // PS + 40) + 64)
                cache = PagedKVCache.allocate(spec, "cuda")
                for t in (cache.k, cache.v):
                    t.normal_()
                q = torch.randn(B, heads[0], 128, device="cuda", dtype=torch.bfloat16)
                times = {}
                steps = {}
                for name, ctas in (("split", 1 << 30), ("fixed", 0)):
                    pool = GraphBufferPool(spec, max_batch_size=B, max_num_tokens=B, max_num_pages=spec.num_pages,
                                           buckets=(B,), max_requests=B, max_pages_per_request=ctx // PS + 40)
                    pool.scheduler_for("flashinfer").fixed_min_ctas = ctas
                    eng = Engine(pool, B, ctx, seed=ctx)
                    graphs = DecodeGraphs(pool, lambda s, x, c=cache: fi.run(s, x["q"], c), {"q": torch.zeros_like(q)})
                    graphs.capture()
                    step = eng.step()
                    graphs(step, q=q)
                    steps[name] = (graphs, step)
                    times[name] = []
                for _ in range(5):
                    for name, (graphs, step) in steps.items():
                        g = graphs.graphs[(step.slot, B, 1, "flashinfer", False)][0]
                        times[name].append(event_median_us(g.replay, 30))
                med = {k: statistics.median(v) for k, v in times.items()}
                out.append(dict(heads=f"{heads[0]}/{heads[1]}", batch=B, context=ctx, ctas=B * heads[1], split_us=med["split"],
                                fixed_us=med["fixed"], fixed_vs_split=med["fixed"] / med["split"] - 1,
                                split_rounds=times["split"], fixed_rounds=times["fixed"]))
                print(out[-1]["heads"], B, ctx, f"{out[-1]['fixed_vs_split']:+.2%}", flush=True)
                del steps, cache
                torch.cuda.empty_cache()
    return out


def part_c(spec_for) -> list[dict]:
    out = []
    layers = 32
    for B, ctx in ((1, 512), (8, 512), (64, 2048), (256, 2048)):
        spec = spec_for((32, 8), B * (ctx // PS + 120) + 64)
        cache = PagedKVCache.allocate(spec, "cuda")
        for t in (cache.k, cache.v):
            t.normal_()
        pool = GraphBufferPool(spec, max_batch_size=256, max_num_tokens=256, max_num_pages=spec.num_pages,
                               max_requests=max(B, 8), max_pages_per_request=ctx // PS + 120)
        eng = Engine(pool, B, ctx)

        def model(step, x):
            h = x["q"]
            for _ in range(layers):
                fi.write_kv(step, x["k"], x["v"], cache)
                h = fi.run(step, h, cache)
            return h

        static = {n: torch.zeros(256, hh, 128, device="cuda", dtype=torch.bfloat16) for n, hh in (("q", 32), ("k", 8), ("v", 8))}
        graphs = DecodeGraphs(pool, model, static)
        graphs.capture(buckets=(pool.bucket_for(build_plan(StepRows.decode(eng.rows, eng.kv + 1), spec)),))
        x = {n: torch.randn(B, t.shape[1], 128, device="cuda", dtype=torch.bfloat16) for n, t in static.items()}
        step = eng.step()
        graphs(step, **x)
        graph = graphs.graphs[(step.slot, step.bucket, 1, "flashinfer", False)][0]
        n = 200

        def timed(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e6

        res = {"replay_only": [], "with_step": []}
        for _ in range(5):
            res["replay_only"].append(timed(graph.replay))
            res["with_step"].append(timed(lambda: graphs(eng.step(), **x)))
        med = {k: statistics.median(v) for k, v in res.items()}
        out.append(dict(batch=B, context=ctx, layers=layers, replay_only_us=med["replay_only"], with_step_us=med["with_step"],
                        exposed=med["with_step"] / med["replay_only"] - 1, rounds=res))
        print(out[-1], flush=True)
        del graphs, pool, cache
        torch.cuda.empty_cache()
    return out


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "torch": torch.__version__,
               "sms": torch.cuda.get_device_properties(0).multi_processor_count, "fixed_min_ctas": fi.FIXED_CTAS_PER_SM}
    ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    spec = AttentionSpec(32, 8, 128, PS, cases.NUM_PAGES)
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["a", "b", "c"]
    spec_for = lambda heads, pages: AttentionSpec(heads[0], heads[1], 128, PS, pages)  # noqa: E731
    if "a" in parts:
        results["host_decode_step"] = part_a(spec, ws)
    if "b" in parts:
        results["fixed_schedule"] = part_b(spec_for)
    if "c" in parts:
        results["exposed_host"] = part_c(spec_for)
    json.dump(results, open(f"{out_dir}/host_step_h100_{''.join(parts)}.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
