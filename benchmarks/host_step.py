"""H100: host work per decode step, side by side with FlashInfer plan(), one process.

(a) host µs per decode step at B = 1, 8, 64, 256 (~2k tokens, page 16, 32/8 heads, d 128), the arms
    taking turns call by call on the same lengths (`interleaved`; paired_ratio: the median of each turn's
    StepRows step / plan()): FlashInfer's own plan(); the StepRows path (StepRows.decode +
    build_plan + commit(defer=True), the pages already in the table: `rows_step`), the same with the
    engine's table.append for the requests starting a page (`rows_step_append`), the same committed
    without defer (the commit launches its own device graph: `rows_step_no_defer`), the StepBatch path
    on the same kind of pool (bucketed, its step run by a decode graph: StepBatch.from_csr of the exact page lists +
    build_plan + commit: `batch_step`; the lists change as pages fill, untimed, as the engine keeps them), and the
    StepBatch path committed eagerly on an unbucketed pool (`batch_step_eager`: its FlashInfer wrapper plans every
    step, so it pays plan() itself);
    host-to-device bytes per step. Every StepRows step is then run by a one-layer decode graph and
    the GPU drained, untimed (a deferred commit's device work runs inside that graph); the engine's
    own update of its lengths follows, untimed, as plan()'s arguments are made outside its arm.
    steady_share: the steps the pool served as steady commits (capture/steady.py).
(b) kernel time of a replayed decode with a per-step split-KV plan vs the fixed schedule (planned
    once, split-KV off) on decode shapes B x context, interleaved rounds.
(c) exposed host time: a 32-layer decode-attention graph (write_kv + run per layer) replayed back to
    back ("replay only": DecodeGraphs calls on a step committed once at the walk's middle lengths) vs the same with the per-step
    StepRows plan + commit before each replay, walking the same lengths (equal KV read on both arms); beside
    them "same lengths": a plan + commit per step at the middle lengths (the commit's own cost, no walk).
    GPU idle µs and GPU items per step from profiler traces of each whole arm (the walk's n steps, n replays): three
    per arm, taking turns, the median's (all three in gpu_idle_rounds).
Run on the GPU: python -m benchmarks.host_step OUT_DIR [a,b,c]   (writes host_step_<device>_<parts>.json, device: cases.device_tag)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks import cases
from benchmarks.timing import gpu_trace, host_us, interleaved, spread
from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES, GraphBufferPool
from mstar_attn.kernels import flashinfer as fi
from mstar_attn.metadata import native
from mstar_attn.metadata.batch import StepRows, bucket_of
from mstar_attn.tuning import event_median_us

import flashinfer  # noqa: E402

PS = cases.PAGE


def table_pool(spec, buckets=None, device=None) -> GraphBufferPool:
    """The part (a) pool: a page table of 1,024 rows x 512 pages, buckets up to 256 requests (or `buckets`)."""
    return GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages,
                                            max_requests=1024, max_pages_per_request=512,
                                            **({} if buckets is None else {"buckets": buckets})), device=device)


def list_pool(spec, B: int, device=None) -> GraphBufferPool:
    """The part (a) pool of steps that list their pages (ListEngine): table_pool's bounds, no table, B's bucket."""
    return GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=4096, max_num_pages=spec.num_pages,
                                            buckets=(bucket_of(B),)), device=device)


class Engine:
    """A decode batch of B requests on a table pool: each step every request gains a token, and the
    ones starting a page get one (table.append). step() is all the host work of one step."""

    def __init__(self, pool, B: int, context: int, seed: int = 0, room: int = 0, defer: bool = True):
        """room: tokens of pages given to each request up front beyond its context (then step_only needs no append).
        defer: commit(defer=True), the step's device work left for the decode graph that runs it."""
        rng = np.random.default_rng(seed)
        self.pool, self.table, self.defer = pool, pool.table, defer
        self.rows = rng.permutation(pool.table.max_requests)[:B].astype(np.int32)
        self.kv = rng.integers(context - 256, context + 256, B).astype(np.int32)
        self.free = list(rng.permutation(pool.spec.num_pages).astype(np.int32))
        for r, k in zip(self.rows, self.kv):
            self.table.assign(int(r), [self.free.pop() for _ in range(-(-(int(k) + room) // PS))])
        self.kv -= 1  # the first step writes the last token of the context
        self.start = self.kv.copy()

    def step_only(self):
        """A step whose pages are in the table already (room): StepRows.decode + build_plan + commit."""
        self.kv += 1
        return self.commit_only()

    def commit_only(self):
        """step_only without the engine's own update of its lengths (kv += 1): the library's calls alone, what
        part (a) times (advance() runs after the step, untimed)."""
        return self.pool.commit(build_plan(StepRows.decode(self.rows, self.kv), self.pool.spec), defer=self.defer)

    def advance(self) -> None:
        self.kv += 1

    def step(self):
        self.kv += 1
        start = (self.kv % PS) == 1  # these requests' new token starts a page
        if start.any():
            rows = self.rows[start]
            self.table.append(rows, [self.free.pop() for _ in range(rows.shape[0])])
        return self.pool.commit(build_plan(StepRows.decode(self.rows, self.kv), self.pool.spec), defer=self.defer)

    def lists(self) -> ListEngine:
        """An engine over the same requests (lengths and each row's pages) that lists its pages per step."""
        held = [self.table.pages(int(r)) for r in self.rows]
        pages = np.full((len(held), max(p.shape[0] for p in held)), -1, np.int32)  # (-1: past a row's pages, never listed)
        for i, p in enumerate(held):
            pages[i, : p.shape[0]] = p
        return ListEngine(pages, self.kv)

    def csr(self) -> StepBatch:
        """This step as a StepBatch listing the pages it reads."""
        return self.lists().batch()


class ListEngine:
    """A decode batch that keeps each request's pages itself and lists them per step (StepBatch.from_csr): the
    pages each length uses, exactly. pages [B, P] int32 (room for the walk), kv [B] the next step's lengths."""

    def __init__(self, pages: np.ndarray, kv: np.ndarray):
        self.pages, self.kv, self.ones = pages, kv.copy(), np.ones(kv.shape[0], np.int32)
        self.list_pages()

    def advance(self) -> None:
        """The next step's lengths and page lists (the engine's own bookkeeping, untimed)."""
        self.kv += 1
        self.list_pages()

    def list_pages(self) -> None:
        """indptr [B+1] and indices int32: each request's first ceil(kv / page) pages."""
        used = -(-self.kv // PS)
        self.indptr = np.zeros(self.kv.shape[0] + 1, np.int32)
        np.cumsum(used, out=self.indptr[1:])
        self.indices = self.pages[np.arange(self.pages.shape[1]) < used[:, None]]

    def batch(self) -> StepBatch:
        return StepBatch.from_csr(self.ones, self.kv, self.indptr, self.indices, PS)

    def commit_only(self, pool):
        """StepBatch.from_csr + build_plan + commit(defer=True) of this step into `pool` (the timed part of a StepBatch
        step; its device work runs in the decode graph that runs the step, as the StepRows arm's)."""
        return pool.commit(build_plan(self.batch(), pool.spec), defer=True)


def one_layer(pool, cache) -> DecodeGraphs:
    """A decode graph of one attention layer over `cache` (what runs each step in part (a), untimed)."""
    q = torch.zeros(max(pool.buckets), 32, 128, device="cuda", dtype=torch.bfloat16)

    def attend(s, x):
        s.mark_stored(cache)  # (timing: the cache is filled by hand)
        return fi.run(s, x["q"], cache)

    graphs = DecodeGraphs(pool, attend, {"q": q})
    graphs.capture()
    return graphs


def part_a(spec, ws, batches=(1, 8, 64, 256)) -> list[dict]:
    rows = []
    cache = PagedKVCache.allocate(spec, "cuda")
    for t in (cache.k, cache.v):
        t.normal_()
    for B in batches:
        pool = table_pool(spec, buckets=(bucket_of(B),))
        eng = Engine(pool, B, 2048, seed=B)
        lean_pool = table_pool(spec, buckets=(bucket_of(B),))
        lean = Engine(lean_pool, B, 2048, seed=B, room=1500)  # (the rounds below decode 1,360 tokens)
        eager_pool = table_pool(spec, buckets=(bucket_of(B),))
        eager = Engine(eager_pool, B, 2048, seed=B, room=1500, defer=False)  # the commit launches its device work
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
        run = {id(p.slots): one_layer(p, cache) for p in (pool, lean_pool, eager_pool)}
        def after(step):  # each step runs, untimed, and the GPU drains: a timed commit never waits for a slot
            run[id(step.slots)](step, q=q)
            torch.cuda.synchronize()

        for _ in range(3):  # each slot's first commit of the bucket captures its device graph, the first run its folded graph
            for e in (eng, lean, eager):
                after(e.step() if e is eng else e.step_only())
        batch = eng.csr()
        plan = build_plan(batch, spec)
        args = (torch.from_numpy(plan.kv_indptr.copy()), torch.from_numpy(plan.kv_indices.copy()).to("cuda"),
                torch.from_numpy(plan.kv_last_page_len.copy()))
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        kw = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.sm_scale)
        raw_plan = lambda: raw.plan(*args, 32, 8, 128, PS, **kw)  # noqa: E731
        old_pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=4096,
                                                    max_num_pages=spec.num_pages))
        old = lambda: old_pool.commit(build_plan(batch, spec))  # noqa: E731
        def raw_after(_):  # plan()'s own kernel runs, untimed, and the GPU drains: the surroundings of our arms
            raw.run(q, (cache.k, cache.v))
            torch.cuda.synchronize()

        before = {e: e.pool.steady.commits for e in (lean, eng)}
        lean.advance(), eager.advance()
        listing = lean.lists()  # the lean engine's requests, listing their pages: the same lengths, step by step
        lists_pool = list_pool(spec, B)
        run[id(lists_pool.slots)] = one_layer(lists_pool, cache)
        t = interleaved({  # call by call: the host's noise hits every arm alike (the lengths advance untimed)
            "flashinfer_plan": (raw_plan, raw_after), "rows_step": (lean.commit_only, lambda st: (after(st), lean.advance())),
            "rows_step_append": (eng.step, after), "rows_step_no_defer": (eager.commit_only, lambda st: (after(st), eager.advance())),
            "batch_step": (lambda: listing.commit_only(lists_pool), lambda st: (after(st), listing.advance())),
            "batch_step_eager": (old, lambda step: (step.mark_stored(cache), fi.run(step, q, cache), torch.cuda.synchronize()))})
        # the share of the steps (the 40 warm-up calls too) the pool served as steady commits (capture/steady.py)
        steady = {k: (e.pool.steady.commits - before[e]) / (len(t[k]) + 40) for k, e in (("rows_step", lean), ("rows_step_append", eng))}
        steady["batch_step"] = lists_pool.steady.commits / (len(t["batch_step"]) + 40)  # (its pool's only steps)
        t["flashinfer_plan_hot"] = []
        for _ in range(3):
            t["flashinfer_plan_hot"] += host_us(raw_plan)  # back to back, nothing between calls
        after(lean.step_only())
        rows_bytes = lean_pool.last_commit_bytes
        after(listing.commit_only(lists_pool))
        old()
        med = {k: statistics.median(v) for k, v in t.items()}
        sched = lean_pool.backend_state("flashinfer")
        rows.append(dict(batch=B, **{f"{k}_us": v for k, v in med.items()}, **{f"{k}_iqr_us": spread(v) for k, v in t.items()},
                         **{f"{k}_mean_us": float(np.mean(v)) for k, v in t.items()},
                         ratio=med["rows_step"] / med["flashinfer_plan"], batch_ratio=med["batch_step"] / med["flashinfer_plan"],
                         batch_eager_ratio=med["batch_step_eager"] / med["flashinfer_plan"],
                         paired_ratio=statistics.median(np.divide(t["rows_step"], t["flashinfer_plan"])),
                         ratio_vs_hot_plan=med["rows_step"] / med["flashinfer_plan_hot"],
                         append_ratio=med["rows_step_append"] / med["flashinfer_plan"],
                         rows_h2d_bytes=rows_bytes, batch_h2d_bytes=lists_pool.last_commit_bytes,
                         batch_eager_h2d_bytes=old_pool.last_commit_bytes,
                         fixed_schedule=bool(sched.fixed), split_kv_plans=len(sched.fast),
                         steady_share=steady["rows_step"], steady_share_append=steady["rows_step_append"],
                         batch_steady_share=steady["batch_step"]))
        print(rows[-1], flush=True)
        del pool, old_pool, lean_pool, eager_pool, lists_pool, run
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

                def attend(s, x, c=cache):
                    s.mark_stored(c)  # (timing: the cache is filled by hand)
                    return fi.run(s, x["q"], c)

                for name, ctas in (("split", 1 << 30), ("fixed", 0)):
                    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=B, max_num_tokens=B,
                                                            max_num_pages=spec.num_pages, buckets=(B,),
                                                            max_requests=B, max_pages_per_request=ctx // PS + 40))
                    pool.backend_state("flashinfer").fixed_min_ctas = ctas
                    eng = Engine(pool, B, ctx, seed=ctx)
                    graphs = DecodeGraphs(pool, attend, {"q": torch.zeros_like(q)})
                    graphs.capture()
                    step = eng.step()
                    graphs(step, q=q)
                    steps[name] = (graphs, step)
                    times[name] = []
                for _ in range(5):
                    for name, (graphs, step) in steps.items():
                        g = graphs.graph_for(step)
                        times[name].append(event_median_us(g.replay, 30))
                med = {k: statistics.median(v) for k, v in times.items()}
                out.append(dict(heads=f"{heads[0]}/{heads[1]}", batch=B, context=ctx, ctas=B * heads[1], split_us=med["split"],
                                fixed_us=med["fixed"], fixed_vs_split=med["fixed"] / med["split"] - 1,
                                split_rounds=times["split"], fixed_rounds=times["fixed"]))
                print(out[-1]["heads"], B, ctx, f"{out[-1]['fixed_vs_split']:+.2%}", flush=True)
                del steps, cache, attend
                torch.cuda.empty_cache()
    return out


def per_step_us(fn, n: int) -> float:
    """Wall-clock µs per step of fn() (one call running n steps), from an idle GPU to the GPU drained."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def decode_forward(B: int, ctx: int, room: int, layers: int = 32):
    """A table pool of B requests of about ctx tokens (pages for `room` more each, see Engine) under a captured
    decode graph of `layers` attention layers (write_kv + run each, 32/8 heads, d 128, page 16, random cache) at
    their bucket. Returns (the Engine, the DecodeGraphs, its live inputs: q, k, v [B, heads, 128] bf16 on CUDA)."""
    spec = AttentionSpec(32, 8, 128, PS, B * (ctx // PS + 120) + 64)
    cache = PagedKVCache.allocate(spec, "cuda")
    for t in (cache.k, cache.v):
        t.normal_()
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=256, max_num_pages=spec.num_pages,
                                            max_requests=max(B, 8), max_pages_per_request=ctx // PS + 120))
    eng = Engine(pool, B, ctx, room=room)

    def model(step, x):
        h = x["q"]
        for _ in range(layers):
            fi.write_kv(step, x["k"], x["v"], cache)
            h = fi.run(step, h, cache)
        return h

    static = {name: torch.zeros(256, hh, 128, device="cuda", dtype=torch.bfloat16) for name, hh in (("q", 32), ("k", 8), ("v", 8))}
    graphs = DecodeGraphs(pool, model, static)
    graphs.capture(buckets=(pool.bucket_for(build_plan(StepRows.decode(eng.rows, eng.kv + 1), spec)),))
    x = {name: torch.randn(B, t.shape[1], 128, device="cuda", dtype=torch.bfloat16) for name, t in static.items()}
    return eng, graphs, x


def part_c() -> list[dict]:
    out = []
    n, rounds = 200, 5
    for B, ctx in ((1, 512), (8, 512), (64, 2048), (256, 2048)):
        eng, graphs, x = decode_forward(B, ctx, room=n + 16)  # pages for the walk up front: both arms decode the same lengths

        def walk():  # the with-step arm: lengths start + 1 .. start + n (mean start + n / 2 + 1/2), a plan and commit each
            eng.kv[:] = eng.start
            for _ in range(n):
                graphs(eng.step_only(), **x)

        def middle():
            """The replay-only arm's step, committed afresh at the walk's middle lengths (a graph reads its
            slot's buffers: whatever was committed there last, so this runs before each round)."""
            eng.kv[:] = eng.start + n // 2 - 1
            return eng.step_only()

        def replay():  # the same DecodeGraphs call (its input copies and the replay), no plan or commit
            step = middle()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                graphs(step, **x)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e6

        def same():  # a plan + commit per step, every step at the replay-only arm's lengths
            for _ in range(n):
                eng.kv[:] = eng.start + n // 2
                graphs(eng.commit_only(), **x)

        walk(), same()  # (warm: each slot's device graph, the plans of these lengths)
        res = {"replay_only": [], "with_step": [], "same_lengths": []}
        for _ in range(rounds):
            res["replay_only"].append(replay())
            res["with_step"].append(per_step_us(walk, n))
            res["same_lengths"].append(per_step_us(same, n))
        med = {k: statistics.median(v) for k, v in res.items()}
        # each arm whole (both read the same KV on average), traced three times, turn by turn: the median's trace
        traces = {"with_step": [], "replay_only": []}
        for _ in range(3):
            traces["with_step"].append(gpu_trace(walk, n))
            still = middle()
            traces["replay_only"].append(gpu_trace(lambda: [graphs(still, **x) for _ in range(n)], n))
        with_trace, replay_trace = (sorted(t, key=lambda r: r["gpu_idle_us"])[1] for t in traces.values())
        out.append(dict(batch=B, context=ctx, layers=32, replay_only_us=med["replay_only"], with_step_us=med["with_step"],
                        same_lengths_us=med["same_lengths"], exposed=med["with_step"] / med["replay_only"] - 1,
                        exposed_same_lengths=med["same_lengths"] / med["replay_only"] - 1, gpu_idle_us=with_trace["gpu_idle_us"],
                        replay_gpu_idle_us=replay_trace["gpu_idle_us"], gpu_items=with_trace["gpu_items"],
                        replay_gpu_items=replay_trace["gpu_items"], rounds=res,
                        gpu_idle_rounds={k: [r["gpu_idle_us"] for r in v] for k, v in traces.items()}))
        print(out[-1], flush=True)
        del graphs, eng
        torch.cuda.empty_cache()
    return out


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__, "torch": torch.__version__,
               "sms": torch.cuda.get_device_properties(0).multi_processor_count, "fixed_ctas_per_sm": fi.FIXED_CTAS_PER_SM,
               "equal_lengths": True, "compiled_step_builder": native.load()}  # (metadata/native.py: built and in use)
    ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    spec = AttentionSpec(32, 8, 128, PS, cases.NUM_PAGES)
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["a", "b", "c"]
    spec_for = lambda heads, pages: AttentionSpec(heads[0], heads[1], 128, PS, pages)  # noqa: E731
    if "a" in parts:
        results["host_decode_step"] = part_a(spec, ws)
    if "b" in parts:
        results["fixed_schedule"] = part_b(spec_for)
    if "c" in parts:
        results["exposed_host"] = part_c()
    json.dump(results, open(f"{out_dir}/host_step_{cases.device_tag()}_{''.join(parts)}.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
