"""GPU: how a commit waiting for its slot's fence should wait, A/B on one machine (a diagnosis, no target).

A host ahead of its GPU waits in SlotLeases.free about one step per commit (capture/lease.py: polled holding the GIL
for BUSY_SECONDS, then sleeping, the naps doubling from 10 µs to 1 ms). A sleep overshoots by the timer's slack, so
the host may wake after the GPU ran out of queued work. The variant ("new") polls holding the GIL for BUSY_SECONDS as
well, then polls yielding the CPU and the GIL (os.sched_yield; it releases the GIL from Python 3.12) up to 2 ms, then
sleeps a quarter of the time waited, at most 1 ms. "old" is the committed wait.

Part (c) of host_step (a 32-layer decode-attention graph, B = 1 and 8, 512 tokens): the walk (StepRows plan + commit
+ the DecodeGraphs call per step, lengths walking) and the same lengths, each with either wait, in 8 interleaved
rounds, the variant first in every other round. Wall-clock µs per step, medians; `balanced`: the mean paired
difference (new - old) per arm over the rounds of each order, averaged over the two orders (the second of a pair
runs warmer); `stalls`: the commits that waited per arm and round (0: the wait was never exercised).
Run on the GPU: python -m benchmarks.fence_wait_ab OUT_DIR   (writes fence_wait_ab_<device>.json, device: cases.device_tag)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from benchmarks import cases
from benchmarks.host_step import decode_forward, per_step_us
from mstar_attn.capture import lease

YIELD_SECONDS = 2e-3


def yielding_free(self, s: int) -> None:
    """SlotLeases.free with the variant's wait (see the module docstring)."""
    if self.fenced[s]:
        want = self.generations[s] & lease.FENCE_MASK
        if self.fence_ints[4 * s] == want:
            return
        self.stalls += 1
        start = time.perf_counter()
        while self.fence_ints[4 * s] != want:
            waited = time.perf_counter() - start
            if waited > lease.SPIN_SECONDS:
                self.streams[s].synchronize()
                if self.fence_ints[4 * s] != want:
                    raise RuntimeError(f"slot {s}: its commit graph ran but did not write fence {want}")
            elif waited > YIELD_SECONDS:
                time.sleep(min(waited / 4, 1e-3))
            elif waited > lease.BUSY_SECONDS:
                os.sched_yield()
    elif not self.ready[s].query():
        self.stalls += 1
        self.ready[s].synchronize()


def balanced(new: list[float], old: list[float]) -> float:
    """The mean of new[r] - old[r] over the rounds where new ran first (even r) and over those where old did (odd r),
    averaged: each order's warm-up advantage cancels."""
    d = [a - b for a, b in zip(new, old)]
    return (statistics.mean(d[0::2]) + statistics.mean(d[1::2])) / 2


def main(out_dir: str) -> None:
    committed, n = lease.SlotLeases.free, 200
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for B, ctx in ((1, 512), (8, 512)):
        eng, graphs, x = decode_forward(B, ctx, room=n + 16)

        def walk():
            eng.kv[:] = eng.start
            for _ in range(n):
                graphs(eng.step_only(), **x)

        def same():
            for _ in range(n):
                eng.kv[:] = eng.start + n // 2
                graphs(eng.commit_only(), **x)

        def replay():  # the same DecodeGraphs call n times on a step committed at the walk's middle lengths
            eng.kv[:] = eng.start + n // 2 - 1
            step = eng.step_only()

            def calls():
                for _ in range(n):
                    graphs(step, **x)

            return per_step_us(calls, n)

        walk(), same()
        arms = ("walk_new", "walk_old", "same_new", "same_old")
        res, stalls = {k: [] for k in ("replay", *arms)}, {k: [] for k in arms}
        pool = eng.pool
        try:
            for r in range(8):
                res["replay"].append(replay())
                order = (("new", yielding_free), ("old", committed))
                for name, free in order if r % 2 == 0 else order[::-1]:
                    lease.SlotLeases.free = free
                    for arm, fn in (("walk_" + name, walk), ("same_" + name, same)):
                        before = pool.stalls
                        res[arm].append(per_step_us(fn, n))
                        stalls[arm].append(pool.stalls - before)
        finally:
            lease.SlotLeases.free = committed
        med = {k: statistics.median(v) for k, v in res.items()}
        out[B] = dict(medians=med, exposed={k: med[k] / med["replay"] - 1 for k in med if k != "replay"},
                      balanced={a: balanced(res[a + "_new"], res[a + "_old"]) for a in ("walk", "same")},
                      rounds=res, stalls=stalls)
        print(B, json.dumps(out[B]["medians"]), json.dumps(out[B]["exposed"]), flush=True)
        del graphs, eng
        torch.cuda.empty_cache()
    json.dump(out, open(f"{out_dir}/fence_wait_ab_{cases.device_tag()}.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
