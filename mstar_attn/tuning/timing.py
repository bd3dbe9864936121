"""GPU timing: CUDA-event medians, the device's copy and matmul ceilings, rounds queued behind a GPU sleep
with L2 flushed before every repetition, host-clock medians. Imports torch only when called."""

from __future__ import annotations

import statistics
import time

def event_median_us(fn, n: int = 10, before=None) -> float:
    """Median µs of n CUDA-event-timed calls of fn after one warm-up call; before(), if given, runs
    ahead of each timed call, outside the events (an L2 flush)."""
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def interleaved_rounds(calls: dict, rounds: int = 5, n: int = 50, timer=event_median_us) -> dict:
    """{key: [round medians]}: each of `calls` (key -> fn) timed by timer(fn, n) once per round, the calls
    interleaved round by round, so slow drift (clocks, temperature) weighs on every arm alike."""
    out = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            out[key].append(timer(fn, n))
    return out


def median_spread(rounds: list[float]) -> str:
    """A results-table cell: the median of the round medians and their min-max spread, "12.3 (12.1-12.9)"."""
    return f"{statistics.median(rounds):.1f} ({min(rounds):.1f}-{max(rounds):.1f})"


def _ceilings() -> dict:
    """Copy bandwidth (1 GiB, read + write) and bf16 matmul rate (8192^3), on random data."""
    import torch

    def matmul_us():
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return event_median_us(lambda: a @ b)

    copy, mm_us = copy_TBps(), matmul_us()
    torch.cuda.empty_cache()
    return {"copy_TBps": copy, "matmul_TFLOPs": 2 * 8192**3 / (mm_us * 1e-6) / 1e12}


def copy_TBps(n: int = 10) -> float:
    """Device copy bandwidth, TB/s counting bytes read plus written: 1 GiB of random bytes."""
    import torch

    x = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (event_median_us(lambda: y.copy_(x), n) * 1e-6) / 1e12


class _Timer:
    """CUDA-event timing of repetitions queued behind a GPU sleep, L2 flushed before each."""

    def __init__(self, flush_bytes: int):
        import torch

        self.torch = torch
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
        self.can_sleep = hasattr(torch.cuda, "_sleep")

    def round(self, fn, reps: int, host_us: float) -> tuple[list[float], bool]:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        g0.record()
        if self.can_sleep:  # >= the host's enqueue time at clocks up to 2 GHz
            torch.cuda._sleep(int(reps * (host_us + 40.0) * 2000))
        g1.record()
        t0 = time.perf_counter()
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        queued = self.can_sleep and enqueue_ms < g0.elapsed_time(g1)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], queued


def host_median_us(fn, n: int, warmup: int = 3, sync_every: int = 0) -> float:
    """Median host µs of n calls of fn after `warmup` calls; sync_every > 0 lets the GPU catch up
    (outside the timed calls) every that many calls, so queued work never throttles the host."""
    for _ in range(warmup):
        fn()
    ts = []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if sync_every and i % sync_every == 0:
            import torch

            torch.cuda.synchronize()
    return statistics.median(ts) * 1e6
