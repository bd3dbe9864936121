"""Per-call cost of attention through the custom op (torch.ops.mstar_attn.forward, what a compiled
model calls) against the direct call it wraps (Attention.forward with the step), same layer, same
step, same inputs, interleaved in rounds; host clock, the device drained after each round.

    python -m benchmarks.op_dispatch [--device cpu|cuda] [--backend reference|flashinfer|flash_attn] [--out DIR]

Both ops a layer calls (forward, store). By default the layer's work with a step is a fixed result (store:
nothing), so the difference is the op's own cost: dispatch, registry and context lookups (the op
returns the layer's output as it is: no buffer, no copy); --real times the backend's work too. Reports per call: the direct call, the op
call, and their difference in the same round, medians over rounds with the 10th-90th percentile
spread. Writes op_dispatch_<device>[_real].json and .md under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import numpy as np
import torch

import mstar_attn as ma
from mstar_attn import GraphBufferPool, PoolLimits, step_context


class NullAttention(ma.Attention):
    """An Attention whose work with a step is a fixed result (store: nothing), so the op's own cost
    (dispatch, registry and context lookups) is all that differs."""

    def forward(self, q, k, v, step=None):
        if step is None:
            return super().forward(q, k, v)
        return self.result

    def store(self, k, v, step=None):
        if step is None:
            super().store(k, v)


def setup(device: str, backend: str, batch: int, null: bool):
    """A decode step of `batch` requests (512 cached tokens each), one layer over a random cache."""
    spec = ma.AttentionSpec(32, 8, 128, 16, 64 * batch + 8, dtype=torch.bfloat16, backend=backend)
    lens = [512] * batch
    pages = [list(range(i * 33, i * 33 + 32)) for i in range(batch)]
    plan = ma.build_plan(ma.StepBatch.from_pages([1] * batch, lens, pages, 16), spec)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=batch, max_num_tokens=batch, max_num_pages=spec.num_pages,
                                            buckets=()), device=device)
    layer = (NullAttention if null else ma.Attention).for_model(spec, device, num_layers=1)[0]
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (layer.cache.k, layer.cache.v):
        t.copy_(torch.randn(t.shape, generator=gen, device=device).to(t.dtype))
    step = pool.commit(plan)
    q, k, v = (torch.randn(batch, h, 128, generator=gen, device=device).to(torch.bfloat16) for h in (32, 8, 8))
    layer.result = torch.randn_like(q)
    return layer, step, q, k, v


def rounds(layer, step, q, k, v, device: str, n_rounds: int, calls: int) -> dict[str, list[float]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    arms = {"attention_direct": lambda: layer.forward(q, k, v, step), "attention_op": lambda: layer.forward(q, k, v),
            "store_direct": lambda: layer.store(k, v, step), "store_op": lambda: layer.store(k, v)}
    out: dict[str, list[float]] = {name: [] for name in arms}
    with step_context(step):
        for fn in arms.values():  # warm every path
            for _ in range(10):
                fn()
        sync()
        for r in range(n_rounds):
            order = list(arms.items())
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync()
                out[name].append((time.perf_counter() - t0) / calls * 1e6)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": float(np.median(xs)), "p10": float(np.percentile(xs, 10)), "p90": float(np.percentile(xs, 90))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="default: flashinfer on CUDA, else reference")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--real", action="store_true", help="time the backend's real work too (default: a fixed result, "
                                                         "so the difference is the op's own cost alone)")
    a = p.parse_args()
    backend = a.backend or ("flashinfer" if a.device == "cuda" else "reference")
    layer, step, q, k, v = setup(a.device, backend, a.batch, null=not a.real)
    t = rounds(layer, step, q, k, v, a.device, a.rounds, a.calls)
    res = {"device": a.device, "backend": backend, "batch": a.batch, "rounds": a.rounds, "calls_per_round": a.calls,
           "backend_work": "real" if a.real else "a fixed result (the op's own cost)",
           "host": platform.processor() or platform.machine(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
           **{f"{name}_us": stats(xs) for name, xs in t.items()}}
    for op in ("attention", "store"):
        res[f"{op}_op_minus_direct_us"] = stats([o - d for o, d in zip(t[f"{op}_op"], t[f"{op}_direct"])])
    out = pathlib.Path(a.out)
    name = f"op_dispatch_{a.device}" + ("_real" if a.real else "")
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    row = lambda s: f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"  # noqa: E731
    md = [f"# Attention through the custom ops vs the direct calls ({a.device}, {backend})", "",
          f"One layer, decode, B = {a.batch}, 512 cached tokens each, bf16, 32/8 heads, d 128; backend work: "
          f"{res['backend_work']}; {a.rounds} interleaved rounds of {a.calls} calls, host clock, device drained per "
          f"round. torch {torch.__version__}" + (f", {res['gpu']}" if res["gpu"] else "") + ".", "",
          "| µs per call, median (p10-p90) | direct (with the step) | op (`step_context`) | op - direct, same round |",
          "|---|---|---|---|"]
    for op, call in (("attention", "forward(q, k, v)"), ("store", "store(k, v)")):
        md.append(f"| `Attention.{call}` | {row(res[f'{op}_direct_us'])} | {row(res[f'{op}_op_us'])} | "
                  f"{row(res[f'{op}_op_minus_direct_us'])} |")
    md.append("")
    (out / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
