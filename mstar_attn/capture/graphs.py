"""CUDA-graph capture of a decode / verify forward per (slot, bucket, q_len), replayed after each commit."""

from __future__ import annotations

import itertools
from typing import Callable

import attrs
import numpy as np
import torch

from mstar_attn.capture.pool import DeviceStep, GraphBufferPool
from mstar_attn.metadata.batch import StepBatch
from mstar_attn.kernels import AUTO
from mstar_attn.metadata.plan import build_plan
from mstar_attn.metadata.select import graph_backends


def warmup_plan(pool: GraphBufferPool, batch_size: int, q_len: int = 1):
    """A plan of `batch_size` requests on page 0 only, for warm-up and capture: decode (q_len 1,
    kv_len 1) or verify (q_len new tokens after one cached token). Running it writes page 0."""
    ps = pool.spec.page_size
    kv = 1 if q_len == 1 else q_len + 1
    per = -(-kv // ps)
    q_lens, kv_lens = np.full(batch_size, q_len, np.int32), np.full(batch_size, kv, np.int32)
    batch = StepBatch.from_csr(q_lens, kv_lens, np.arange(batch_size + 1) * per, np.zeros(batch_size * per), ps)
    return build_plan(batch, pool.spec, check_ownership=False)


class DecodeGraphs:
    """fn(step, inputs) -> Tensor [num_rows, ...], captured once per (pool slot, bucket, q_len).

    inputs: static device buffers, each [max bucket * max q_len, ...]; a call copies the live
    inputs into their first rows and replays. q_len 1 is decode; q_len > 1 serves verify steps
    of that q_len (capture them with `capture(q_lens=...)`). Steps the pool does not bucket
    (past the largest bucket, other modes) and uncaptured q_lens run `fn` eagerly. All graphs
    share one memory pool, so a replay's output is valid until the next replay of any graph of
    this DecodeGraphs: read or copy it first. Capture before serving: warm-up and capture write
    page 0.
    """

    def __init__(self, pool: GraphBufferPool, fn: Callable[[DeviceStep, dict], torch.Tensor], inputs: dict[str, torch.Tensor]):
        self.pool, self.fn, self.inputs = pool, fn, inputs
        self.memory = torch.cuda.graph_pool_handle()
        # (slot, bucket, q_len, backend) -> (graph, its output)
        self.graphs: dict[tuple[int, int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, buckets: tuple[int, ...] | None = None, q_lens: tuple[int, ...] = (1,),
                backends: tuple[str, ...] | None = None) -> None:
        """Capture every (bucket, q_len, backend, slot). backends: default the spec's backend; with
        spec.backend "auto", every backend the dispatch table may pick for this spec's decode and
        verify steps (select.graph_backends)."""
        spec = self.pool.spec
        if backends is None:
            backends = (spec.backend,) if spec.backend != AUTO else graph_backends(spec)
        for bucket, q_len, backend, slot in itertools.product(buckets or self.pool.buckets, q_lens, backends,
                                                               range(self.pool.num_slots)):
            plan = attrs.evolve(warmup_plan(self.pool, bucket, q_len), backend=backend)
            step = self.pool.commit(plan, slot=slot)
            if step.bucket is None:
                raise ValueError(f"capture: the pool does not bucket q_len {q_len} steps (verify needs q_len <= page_size "
                                 "and causal groups)")
            static = {name: t[: step.num_rows] for name, t in self.inputs.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: JIT, lazily allocated library buffers
                self.fn(step, static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory):
                out = self.fn(step, static)
            self.graphs[(slot, bucket, q_len, backend)] = (graph, out)
        torch.cuda.synchronize()

    def serves(self, step: DeviceStep) -> bool:
        """Whether `step` replays a graph: bucketed, and captured for its q_len and its backend."""
        return step.bucket is not None and (step.slot, step.bucket, step.q_len, step.plan.backend) in self.graphs

    def __call__(self, step: DeviceStep, **inputs: torch.Tensor) -> torch.Tensor:
        if not self.serves(step):
            return self.fn(step, inputs)
        graph, out = self.graphs[(step.slot, step.bucket, step.q_len, step.plan.backend)]
        for name, t in inputs.items():
            self.inputs[name][: t.shape[0]].copy_(t)
        graph.replay()
        return out[: step.plan.num_tokens]
