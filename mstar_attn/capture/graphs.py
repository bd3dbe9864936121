"""CUDA-graph capture of a decode forward per (slot, bucket), replayed after each commit."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from mstar_attn.capture.pool import DeviceStep, GraphBufferPool
from mstar_attn.metadata.batch import StepBatch
from mstar_attn.metadata.plan import Mode, build_plan


def warmup_plan(pool: GraphBufferPool, batch_size: int):
    """A decode plan of `batch_size` one-token requests reading page 0: only for warm-up and capture."""
    ones = np.ones(batch_size, np.int32)
    batch = StepBatch.from_csr(ones, ones, np.arange(batch_size + 1), np.zeros(batch_size), pool.spec.page_size)
    return build_plan(batch, pool.spec, check_ownership=False)


class DecodeGraphs:
    """fn(step, inputs) -> Tensor [rows, ...], captured once per (pool slot, bucket).

    inputs: static device buffers, each [max bucket, ...]; a call copies the live inputs into
    their first rows and replays. Decode steps past the largest bucket, and every other mode,
    run `fn` eagerly. All graphs share one memory pool.
    """

    def __init__(self, pool: GraphBufferPool, fn: Callable[[DeviceStep, dict], torch.Tensor], inputs: dict[str, torch.Tensor]):
        self.pool, self.fn, self.inputs = pool, fn, inputs
        self.memory = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, buckets: tuple[int, ...] | None = None) -> None:
        for bucket in buckets or self.pool.buckets:
            plan = warmup_plan(self.pool, bucket)
            for slot in range(self.pool.num_slots):
                step = self.pool.commit(plan, slot=slot)
                static = {name: t[:bucket] for name, t in self.inputs.items()}
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: JIT, lazily allocated library buffers
                    self.fn(step, static)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.memory):
                    out = self.fn(step, static)
                self.graphs[(slot, bucket)] = (graph, out)
        torch.cuda.synchronize()

    def __call__(self, step: DeviceStep, **inputs: torch.Tensor) -> torch.Tensor:
        entry = self.graphs.get((step.slot, step.bucket)) if step.mode is Mode.DECODE else None
        if entry is None:
            return self.fn(step, inputs)
        graph, out = entry
        for name, t in inputs.items():
            self.inputs[name][: t.shape[0]].copy_(t)
        graph.replay()
        return out[: step.plan.num_tokens]
