"""A long soak on the GPU: thousands of random steps through both paged backends, eager and replayed,
checked per request every `check_every` steps, with device and host memory sampled throughout.

    python -m benchmarks.soak OUT_DIR [--steps 10000] [--check-every 10] [--seed 0]

Each step draws a mode (decode 55%, verify q_len 4 or 3 15%, prefill 10%, extend 10%, mixed 10%),
a batch size crossing the buckets (1..128) and past the largest (up to 160), lengths up to ~5k
tokens over two layer groups (full causal, a 256-token window), and fresh random pages, q, k, v.
Every backend (FlashInfer paged, FlashAttention-4 paged) gets the same steps: commit, then a
DecodeGraphs call whose function writes the new K/V and runs both groups, replayed for captured
decode / verify buckets and eager otherwise. Every check_every-th step both groups' outputs are
compared per request with the float32 reference (tests.helpers bounds). Memory (torch device
allocated / reserved, pinned host, process RSS, the pool's bookkeeping counts) is sampled every
100 steps; after an engine-like warm-up (every bucketed shape committed once per slot) and
the first 2,000 steps it must not grow. Writes soak_h100.json and soak_h100.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from mstar_attn import AttentionSpec, LayerGroup, PlanError, PoolLimits, StepBatch, build_plan, kernels
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, scratch_plan
from benchmarks.pool_memory import pinned_owned
from tests.helpers import UNIT_ROUNDOFF, random_cache, request_errors

NUM_PAGES = 48000
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
GROUPS = (LayerGroup(), LayerGroup("window", window=256))
WARMUP = 2000


def pinned_bytes() -> int:
    return pinned_owned(torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {})


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def draw_step(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    mode = rng.choice(["decode", "verify", "prefill", "extend", "mixed"], p=[0.55, 0.15, 0.1, 0.1, 0.1])
    B = int(rng.choice([rng.integers(1, 129), rng.integers(129, 161)], p=[0.9, 0.1]))
    if mode in ("prefill", "extend", "mixed"):
        B = max(1, B // 8)
    prefix = rng.integers(0, 5000, B) * (rng.random(B) < 0.9)
    if mode == "decode":
        q = np.ones(B, np.int64)
        prefix = np.maximum(prefix, 0)
    elif mode == "verify":
        q = np.full(B, int(rng.choice([3, 4])), np.int64)
        prefix = np.maximum(prefix, 1)
    elif mode == "prefill":
        q, prefix = rng.integers(1, 600, B), np.zeros(B, np.int64)
    else:
        q = rng.integers(2, 300, B)
        if mode == "mixed":
            q[rng.random(B) < 0.5] = 1
    return q.astype(np.int32), (q + prefix).astype(np.int32)


def random_pages(rng, kv: np.ndarray, ps: int) -> tuple[np.ndarray, np.ndarray] | None:
    need = (kv.astype(np.int64) + ps - 1) // ps
    if need.sum() > NUM_PAGES:
        return None
    indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
    return indptr, rng.permutation(NUM_PAGES)[: indptr[-1]].astype(np.int32)


def main(out_dir: str, steps: int = 10000, check_every: int = 10, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    setups = {}
    for backend in ("flashinfer", "flash_attn"):
        spec = AttentionSpec(32, 8, 128, 16, NUM_PAGES, groups=GROUPS, backend=backend)
        cache = random_cache(spec, seed)
        pool = GraphBufferPool(spec, PoolLimits(max_batch_size=160, max_num_tokens=40000, max_num_pages=NUM_PAGES,
                                                buckets=BUCKETS, max_pages_per_request=400))
        static = {n: torch.zeros(128 * MAX_VERIFY_Q_LEN, h, 128, device="cuda", dtype=torch.bfloat16) for n, h in (("q", 32), ("k", 8), ("v", 8))}

        def layer(step, x, cache=cache):  # -> [rows, groups, heads, head_dim]: rows first, as DecodeGraphs slices
            kernels.write_kv(step, x["k"], x["v"], cache)
            return torch.stack([kernels.run(step, x["q"], cache, group=g) for g in range(len(GROUPS))], dim=1)

        graphs = DecodeGraphs(pool, layer, static)
        graphs.capture(q_lens=(1, 4))
        for b in BUCKETS:  # an engine's warm-up: every bucketed shape (decode, verify q_len 2..16) once per slot
            for q_len in range(1, MAX_VERIFY_Q_LEN + 1):
                for _ in range(pool.num_slots):
                    graphs(pool.commit(scratch_plan(spec, b, q_len)), **{n: t[: b * q_len] for n, t in static.items()})
        setups[backend] = (spec, cache, pool, graphs)
    torch.cuda.synchronize()
    counts = {b: {"replayed": 0, "eager": 0, "checked_steps": 0, "checked_requests": 0, "mismatches": [], "modes": {}}
              for b in setups}
    worst = {b: 0.0 for b in setups}
    u = UNIT_ROUNDOFF[torch.bfloat16]

    def one_step(i: int) -> int:
        """Step i through every backend; its tensors die on return, so memory samples see state only.
        Returns how many draws did not fit the cache (drawn again)."""
        redraws = 0
        while True:
            q_lens, kv_lens = draw_step(rng)
            pages = random_pages(rng, kv_lens, 16)
            if pages is not None and q_lens.sum() <= 40000:
                break
            redraws += 1
        batch = StepBatch.from_csr(q_lens, kv_lens, *pages, 16)
        T = int(q_lens.sum())
        x = {"q": torch.randn(T, 32, 128, device="cuda", generator=gen).to(torch.bfloat16),
             "k": torch.randn(T, 8, 128, device="cuda", generator=gen).to(torch.bfloat16),
             "v": torch.randn(T, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)}
        for backend, (spec, cache, pool, graphs) in setups.items():
            plan = build_plan(batch, spec)
            c = counts[backend]
            try:
                step = pool.commit(plan)
            except PlanError as e:  # a request past FA4's max_pages_per_request: refused by name, never run
                c.setdefault("refused", []).append(f"step {i}: {e}")
                continue
            c["modes"][plan.mode.value] = c["modes"].get(plan.mode.value, 0) + 1
            c["replayed" if graphs.serves(step) else "eager"] += 1
            out = graphs(step, **x)
            if i % check_every:
                continue
            c["checked_steps"] += 1
            for g in range(len(GROUPS)):
                want = reference.run(plan, x["q"].float(), cache, group=g)
                for r, (rel, abs_err, scale) in enumerate(request_errors(out[:T, g], want, plan)):
                    c["checked_requests"] += 1
                    worst[backend] = max(worst[backend], rel)
                    if not (rel <= 2 * u and abs_err <= 8 * u * max(1.0, scale)):
                        c["mismatches"].append(dict(step=i, group=g, request=r, rel=rel, abs=abs_err, mode=plan.mode.value))
        return redraws

    samples, t0, skipped = [], time.perf_counter(), 0
    for i in range(steps):
        skipped += one_step(i)
        if i % 100 == 0:
            torch.cuda.synchronize()
            samples.append(dict(step=i, allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                                pinned=pinned_bytes(), rss=rss_bytes(),
                                views={b: len(s[2]._views) for b, s in setups.items()},
                                wrappers=len(setups["flashinfer"][2].backend_state("flashinfer").wrappers)))
            if i % 1000 == 0:
                print(f"step {i}: {time.perf_counter() - t0:.0f} s, {samples[-1]}", flush=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    result = dict(device=torch.cuda.get_device_name(), steps=steps, redrawn=skipped, check_every=check_every, seed=seed,
                  wall_s=round(wall, 1), counts=counts, worst_rel=worst, samples=samples)
    return report(result, out_dir)


def memory_verdict(samples: list[dict]) -> dict:
    """Memory after warm-up. Device allocated and pinned bytes count live tensors, and between steps
    only state is alive: the last sample must not exceed the first (no net growth), and no sample
    may exceed it by more than 1 MiB (a transient: objects awaiting Python's cycle collector).
    Reserved may grow when a later step asks the caching allocator for a larger block
    (fragmentation, not a leak): reported, not judged. RSS (the Python heap, noisy by tens of MiB
    from step to step): the median of the last quarter of samples within 32 MiB of the first quarter's."""
    after = [s for s in samples if s["step"] >= WARMUP]
    out = {}
    for k in ("allocated", "reserved", "pinned"):
        out[k] = dict(first=after[0][k], last=after[-1][k], net=after[-1][k] - after[0][k],
                      peak_over_first=max(s[k] for s in after) - after[0][k])
    q = max(1, len(after) // 4)
    rss = [s["rss"] for s in after]
    out["rss_trend"] = statistics.median(rss[-q:]) - statistics.median(rss[:q])
    out["flat"] = all(out[k]["net"] <= 0 and out[k]["peak_over_first"] <= 1 << 20 for k in ("allocated", "pinned")) \
        and out["rss_trend"] < 32 << 20
    return out


def report(result: dict, out_dir: str) -> int:
    counts, worst, samples, steps = result["counts"], result["worst_rel"], result["samples"], result["steps"]
    mem = result["memory"] = memory_verdict(samples)
    flat = mem["flat"]
    after = [s for s in samples if s["step"] >= WARMUP]
    json.dump(result, open(f"{out_dir}/soak_h100.json", "w"), indent=1)
    ok = flat and not any(c["mismatches"] for c in counts.values())
    md = [f"# Soak on {result['device']}: {steps} random steps, both paged backends, eager and replayed", "",
          f"Seed {result['seed']}; {result['wall_s']:.0f} s; every {result['check_every']}th step checked per request against "
          f"the float32 reference "
          f"(norm-relative <= 2u, max abs <= 8u max(1, |ref|), u = 2^-8); memory sampled every 100 steps, between "
          f"steps (only state alive), judged after step {WARMUP} (`memory_verdict`: no net growth of device-allocated "
          f"or pinned bytes, transients under 1 MiB, RSS trend under 32 MiB).", "",
          "| backend | steps | replayed | eager | modes | checked steps | checked requests | mismatches | worst per-request rel. error | refused |",
          "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for b, c in counts.items():
        md.append(f"| {b} | {c['replayed'] + c['eager']} | {c['replayed']} | {c['eager']} | "
                  f"{', '.join(f'{m} {n}' for m, n in sorted(c['modes'].items()))} | {c['checked_steps']} | "
                  f"{c['checked_requests']} | {len(c['mismatches'])} | {worst[b]:.2e} | {len(c.get('refused', []))} |")
    md += ["", f"Memory after step {WARMUP}, last sample minus first (largest excursion above the first): device "
               f"allocated {mem['allocated']['net']:+d} B ({mem['allocated']['peak_over_first']} B), pinned "
               f"{mem['pinned']['net']:+d} B ({mem['pinned']['peak_over_first']} B) of {mem['pinned']['first'] / 2**20:.1f} MiB, "
               f"reserved {mem['reserved']['net']:+d} B; RSS trend {mem['rss_trend'] / 2**20:+.1f} MiB. Device allocated "
               f"{statistics.median(s['allocated'] for s in after) / 2**30:.2f} GiB (median: caches, pools, graphs), pool views "
               f"{after[-1]['views']}, FlashInfer wrappers {after[-1]['wrappers']}. Flat: {'yes' if flat else 'NO'}.",
           "", f"Result: {'clean' if ok else 'FAILED'}."]
    open(f"{out_dir}/soak_h100.md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    kw = {}
    for flag, key in (("--steps", "steps"), ("--check-every", "check_every"), ("--seed", "seed")):
        if flag in args:
            j = args.index(flag)
            kw[key] = int(args[j + 1])
            del args[j : j + 2]
    sys.exit(main(args[0] if args else ".", **kw))
