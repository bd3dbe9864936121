"""Host-side timing for the benchmarks: per-call host µs (alone, or arms taking turns call by call) and a CUDA-only
profiler trace's GPU idle time and items per step. Run on the GPU machine."""

from __future__ import annotations

import time

import numpy as np
import torch


def host_us(fn, n=400, warmup=40, sync_every=50, after=None) -> list[float]:
    """Host µs of each of n calls of fn; after(fn's result), if given, runs untimed after each call."""
    for _ in range(warmup):
        r = fn()
        if after is not None:
            after(r)
    torch.cuda.synchronize()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = fn()
        out.append((time.perf_counter() - t0) * 1e6)
        if after is not None:
            after(r)
        r = None  # (its objects freed here, untimed: never inside the next call's timing)
        if i % sync_every == 0:
            torch.cuda.synchronize()
    return out


def interleaved(arms: dict, n=1200, warmup=40, sync_every=50) -> dict[str, list[float]]:
    """Host µs of n calls of each arm, the arms taking turns call by call (their order rotating each turn), so slow
    phases of a noisy host fall on every arm alike. arms: name -> (fn, after); after(fn's result) runs untimed."""
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            fn, after = arms[name]
            after(fn())
    torch.cuda.synchronize()
    out = {name: [] for name in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            fn, after = arms[name]
            t0 = time.perf_counter()
            r = fn()
            out[name].append((time.perf_counter() - t0) * 1e6)
            after(r)
            r = None  # (its objects freed here, untimed: never inside the next arm's timing)
        if i % sync_every == 0:
            torch.cuda.synchronize()
    return out


def spread(xs):
    q = np.percentile(xs, [25, 75])
    return float(q[1] - q[0])


def cuda_spans(fn) -> list[tuple[float, float, str]]:
    """The GPU items (kernels, copies) of one call of fn(), from a CUDA-only profiler trace started with an idle GPU
    and ended with it drained: (start µs, end µs, name) each, by start."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # (GPU activity only: CPU tracing would slow the host arm)
        fn()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)


def gpu_trace(fn, n: int) -> dict:
    """Per step of fn() (one call running n steps), from cuda_spans: GPU idle µs (the span from the first item's start
    to the last one's end, less the union of the items' intervals), GPU items (kernels, copies), span and busy µs, and
    per item kind [count, µs]."""
    spans = cuda_spans(fn)
    busy, end, kinds = 0.0, -1e30, {}
    for a, b, name in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
        k = kinds.setdefault(name[:48], [0, 0.0])  # per item kind (its name's first 48 characters): count, µs
        k[0], k[1] = k[0] + 1, k[1] + b - a
    span = spans[-1][1] - spans[0][0]
    return dict(gpu_idle_us=(span - busy) / n, gpu_items=len(spans) / n, span_us=span / n, busy_us=busy / n,
                kinds={k: [c / n, t / n] for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])})
