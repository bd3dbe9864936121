"""A commit's device work (copies, table updates, derivations, gathers), captured as one CUDA graph per
key and replayed by every later commit of that key: its host cost is then one graph launch. A
derived StepRows commit may leave its work for the step's first use (`defer`): a decode graph then
replays it as its own first nodes (capture/graphs.py), and one launch per step serves both."""

from __future__ import annotations

import gc
from typing import Callable, TypeVar

import attrs
import torch

from mstar_attn.metadata.errors import PlanError


_T = TypeVar("_T")


def capture_into(graph: torch.cuda.CUDAGraph, memory, fn: Callable[[], _T], mode: str = "global") -> _T:
    """fn() captured into `graph` (of the memory pool `memory`); returns what fn returned. No garbage is
    collected during the capture (the collector is off, and back on after, also when fn raises): a library
    object finalized inside a capture (a kernel module unloaded, a buffer freed on another stream) is an
    illegal call there and aborts the process. mode: torch's capture_error_mode ("thread_local": CUDA calls
    of other threads, serving other pools, do not invalidate the capture)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=memory, capture_error_mode=mode):
            return fn()
    finally:
        if collecting:
            gc.enable()


@attrs.define  # (made per step: a plain __init__, not a frozen one; nothing changes one after it is made)
class Pending:
    """A commit whose device work is deferred and not launched yet: its slot's generation, its graph key,
    and the stream it was committed on (None: a CPU pool)."""

    generation: int
    key: tuple
    stream: object = None


class CommitGraphs:
    """One graph per key (keys name a pool slot, a bucketed shape and a kind of work, so they are
    bounded by the pool's constructor arguments), all in one CUDA memory pool. On the CPU, and for
    steps no bucket serves, the work just runs.

    pending[s]: slot s's last commit while its work is deferred and not yet launched (Pending), else
    None. Work is launched in commit order: a commit launches every pending work
    before it stages anything (`launch_all`), so table updates reach the device in the order they
    were made, and a slot's staging is never rewritten under a copy that has not run."""

    def __init__(self, device: torch.device, num_slots: int):
        self.cuda = device.type == "cuda"
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.works: dict[tuple, Callable[[], None]] = {}  # a captured or deferred key's work (bounded like graphs)
        self.pending: list[Pending | None] = [None] * num_slots
        self.memory = None

    def run(self, key: tuple, bucketed: bool, work: Callable[[], None]) -> None:
        """Replay key's graph if it was captured, else run `work` and, for a bucketed step on CUDA
        outside any capture, capture it for the next time."""
        graph = self.graphs.get(key) if bucketed else None  # (an unbucketed step always runs its work)
        if graph is not None:
            graph.replay()
            return
        work()
        if bucketed and not (self.cuda and torch.cuda.is_current_stream_capturing()):
            self.prepare(key, work)

    def prepare(self, key: tuple, work: Callable[[], None]) -> None:
        """Capture key's work (a bucketed key) without running it, unless captured already: a warm-up, so that
        no serving commit captures it. A no-op on the CPU."""
        if self.cuda and key not in self.graphs:
            if self.memory is None:
                self.memory = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            capture_into(graph, self.memory, work)
            self.graphs[key], self.works[key] = graph, work

    def defer(self, slot: int, generation: int, key: tuple, make: Callable[[object], Callable[[], None]], step,
              stream) -> None:
        """Leave the work of slot's commit `generation` (a bucketed key; make(step) returns it, for the DeviceStep
        `step`: called unless the key's graph is captured already) for the step's first use, on `stream` (the
        commit's; None on the CPU)."""
        if key not in self.graphs:  # (on the CPU, or until captured: the latest step's own work runs)
            self.works[key] = make(step)
        self.pending[slot] = Pending(generation, key, stream)

    def drop(self, slot: int) -> None:
        """Forget slot's pending work unlaunched (its commit failed after deferring it)."""
        self.pending[slot] = None

    def pending_key(self, slot: int, generation: int) -> tuple | None:
        """The key of the work commit `generation` of `slot` still has to launch, or None."""
        p = self.pending[slot]
        return p.key if p is not None and p.generation == generation else None

    def launch(self, slot: int, where: str) -> None:
        """Launch slot's deferred work now, on its commit's stream (a no-op when none is pending).
        PlanError inside a CUDA graph capture: the work would replay with every replay of that graph."""
        p = self.pending[slot]
        if p is None:
            return
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise PlanError(f"{where}: this step was committed with defer=True and is first used inside a CUDA graph "
                            "capture; its commit's device work must run once, outside the graph: call step.prepare() "
                            "before capturing (DecodeGraphs does this for you)")
        self.pending[slot] = None
        if p.stream is None:
            self.run(p.key, True, self.works[p.key])
        else:
            with torch.cuda.stream(p.stream):
                self.run(p.key, True, self.works[p.key])

    def taken(self, slot: int) -> None:
        """Slot's deferred work was launched by a graph that replays it as its first nodes (DecodeGraphs)."""
        self.pending[slot] = None

    def launch_all(self, where: str) -> None:
        """Launch every slot's pending work (a commit does, before staging anything)."""
        for s, p in enumerate(self.pending):
            if p is not None:
                self.launch(s, where)
