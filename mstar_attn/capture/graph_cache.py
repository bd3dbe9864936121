"""A commit's device work (copies, table scatter, derivations, gathers), captured as one CUDA graph per
key and replayed by every later commit of that key: its host cost is then one graph launch."""

from __future__ import annotations

from typing import Callable

import torch


class CommitGraphs:
    """One graph per key (keys name a pool slot, a bucketed shape and a kind of work, so they are
    bounded by the pool's constructor arguments), all in one CUDA memory pool. On the CPU, and for
    steps no bucket serves, the work just runs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.memory = None

    def run(self, key: tuple, bucketed: bool, work: Callable[[], None]) -> None:
        """Replay key's graph if it was captured, else run `work` and, for a bucketed step on CUDA
        outside any capture, capture it for the next time."""
        graph = self.graphs.get(key) if bucketed else None  # (an unbucketed step always runs its work)
        if graph is not None:
            graph.replay()
            return
        work()
        if bucketed and self.cuda and not torch.cuda.is_current_stream_capturing():
            if self.memory is None:
                self.memory = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory):
                work()
            self.graphs[key] = graph
