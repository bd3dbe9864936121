"""CUDA-graph capture of a decode / verify forward per (slot, bucket, q_len, backend), and of a whole
draft round per (slot, bucket, K, backend), replayed after each commit."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from mstar_attn.capture.graph_cache import capture_into
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata.backends import AUTO, BACKENDS
from mstar_attn.metadata.draft import scratch_round
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, check_tree_spec, scratch_plan
from mstar_attn.metadata.select import graph_backends


def _record(fn, step, static: dict[str, torch.Tensor], memory) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn(step, static) warmed up once on a side stream (JIT, lazily allocated library buffers), then
    captured into a graph of the shared memory pool `memory`; returns the graph and its output. The
    scratch steps count as stored for every cache (a forward that only attends, its K/V stored by the
    engine outside the graph, warms up too)."""
    for s in step if isinstance(step, tuple) else (step,):
        s.mark_stored()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(step, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = capture_into(graph, memory, lambda: fn(step, static))
    return graph, out


def graph_key(step: DeviceStep) -> tuple[int, int, int, str, bool, bool]:
    """A decode / verify graph's key: (slot, bucket, q_len, backend, whether a cascade step, whether a token-tree
    step)."""
    return step.slot, step.bucket, step.q_len, step.plan.backend, step.plan.cascade is not None, step.plan.tree is not None


class DecodeGraphs:
    """fn(step, inputs) -> Tensor [padded_num_tokens, ...], captured once per (pool slot, bucket, q_len, backend,
    whether a cascade step: plan.cascade, whether a token-tree verify step: plan.tree).

    inputs: static device buffers, each [max bucket * max q_len, ...]; a call copies the live
    inputs into their first rows and replays. q_len 1 is decode; q_len > 1 serves verify steps
    of that q_len (capture them with `capture(q_lens=...)`). Steps the pool does not bucket
    (past the largest bucket, other modes) and uncaptured q_lens run `fn` eagerly. All graphs
    share one memory pool, so a replay's output is valid until the next replay of any graph of
    this DecodeGraphs: read or copy it first.

    Capture warms up and records on `scratch_plan` steps, which write only the scratch page, so it
    may run while requests hold KV; it commits into every pool slot, so steps committed before it
    are stale afterwards.
    """

    def __init__(self, pool: GraphBufferPool, fn: Callable[[DeviceStep, dict], torch.Tensor], inputs: dict[str, torch.Tensor]):
        if not isinstance(pool, GraphBufferPool):
            raise PlanError(f"DecodeGraphs: pool must be a GraphBufferPool, got {type(pool).__name__}")
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise PlanError(f"DecodeGraphs: inputs[{name!r}] must be a tensor with a row dimension")
        self.pool, self.fn, self.inputs = pool, fn, dict(inputs)
        self.memory = None  # the graphs' shared memory pool, made at the first capture
        # (slot, bucket, q_len, backend, cascade, tree) -> (graph, its output)
        self.graphs: dict[tuple[int, int, int, str, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the same keys and the kind of commit work ("derived", "listed") -> the graph that first runs a deferred
        # commit's device work (commit(defer=True)), captured at the first such step of the key: then one launch per
        # step does both
        self.prepared: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _check_capture(self, buckets, q_lens, backends, trees: bool = False) -> None:
        pool = self.pool
        bad = [b for b in buckets if b not in pool.buckets]
        if bad:
            raise PlanError(f"DecodeGraphs.capture: buckets {bad} are not the pool's buckets {pool.buckets}: "
                            "no step is ever padded to them, so their graphs could never replay")
        top = pool.max_verify_q_len if trees else min(pool.max_verify_q_len, MAX_VERIFY_Q_LEN)
        for q in q_lens:
            if not (isinstance(q, int) and 1 <= q <= top):
                raise PlanError(f"DecodeGraphs.capture: q_len {q!r} is not bucketed by this pool (decode is 1; verify "
                                f"2..{MAX_VERIFY_Q_LEN}, with trees=True up to PoolLimits.max_tree_nodes: this pool "
                                f"{pool.max_verify_q_len}; causal layer groups only)")
        long = [q for q in q_lens if q > MAX_VERIFY_Q_LEN]
        if long and not any(BACKENDS[b].tree for b in backends if b in BACKENDS):  # (past 16: tree graphs only)
            raise PlanError(f"DecodeGraphs.capture: q_lens {long} are token-tree steps only, and none of the backends "
                            f"{list(backends)} verifies token trees")
        for name in backends:
            caps = BACKENDS.get(name)
            if caps is None or "decode" not in caps.modes or caps.prefix_free:
                raise PlanError(f"DecodeGraphs.capture: backend {name!r} does not serve decode steps over a paged cache")
            caps.check(pool.spec, name)
        rows = max(buckets) * max(q_lens)
        short = [n for n, t in self.inputs.items() if t.shape[0] < rows]
        if short:
            raise PlanError(f"DecodeGraphs.capture: inputs {short} have fewer than {rows} rows (largest bucket x q_len)")
        if pool.device.type != "cuda":
            raise PlanError(f"DecodeGraphs.capture: CUDA graphs need a CUDA pool, not {pool.device}")

    def capture(self, buckets: tuple[int, ...] | None = None, q_lens: tuple[int, ...] = (1,),
                backends: tuple[str, ...] | None = None, cascade: bool | None = None, trees: bool = False) -> None:
        """Capture every (bucket, q_len, backend, slot). buckets: default the pool's; backends: default
        the spec's backend; with spec.backend "auto", every backend the dispatch table may pick for
        this spec's decode and verify steps (select.graph_backends). cascade (default: whether the
        spec has cascade on): also capture shared-prefix steps (plan.cascade) of every bucket of 2+
        rows for the backends that run them (Capabilities.cascade): a graph of their own, on a cascade scratch plan.
        trees: also capture token-tree verify steps (build_tree_plan: every tree of the step q_len tokens) of
        every q_len > 1 for the backends that serve them (Capabilities.tree): a graph of their own, on a scratch
        plan of chains, which replays any tree of that size (the mask is data the commit writes); q_lens past
        MAX_VERIFY_Q_LEN (up to PoolLimits.max_tree_nodes) capture token-tree steps only. A pool with a cross table
        also captures its commits' cross-table device work of these shapes (GraphBufferPool.capture_cross)."""
        spec = self.pool.spec
        buckets = tuple(self.pool.buckets if buckets is None else buckets)
        if backends is None:
            backends = (spec.backend,) if spec.backend != AUTO else graph_backends(spec)
        self._check_capture(buckets, tuple(q_lens), tuple(backends), trees)
        if trees:  # (before any capture: a spec that cannot verify trees fails here, not halfway)
            check_tree_spec(spec)
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        cascade = bool(spec.cascade_groups) if cascade is None else cascade
        for bucket, q_len, backend, slot in itertools.product(buckets, q_lens, backends, range(self.pool.num_slots)):
            kinds = [(False, False)] if q_len <= MAX_VERIFY_Q_LEN else []  # (past it: token trees only)
            if cascade and bucket >= 2 and BACKENDS[backend].cascade:
                kinds.append((True, False))
            if trees and q_len > 1 and BACKENDS[backend].tree:
                kinds.append((False, True))
            for levels, tree in kinds:
                plan = scratch_plan(spec, bucket, q_len, backend=backend, cascade=levels, tree=tree)
                step = self.pool.commit(plan, slot=slot)
                static = {name: t[: step.padded_num_tokens] for name, t in self.inputs.items()}
                self.graphs[graph_key(step)] = _record(self.fn, step, static, self.memory)
        self.pool.capture_cross(buckets, tuple(q_lens))  # (a pool with a cross table: its commits' device work too)
        torch.cuda.synchronize()

    def serves(self, step: DeviceStep) -> bool:
        """Whether `step` replays a graph: this pool's, bucketed, and captured for its q_len, its backend and its
        kind (cascade, token tree: capture(trees=True)); never a step of a draft round: its arrays are not where
        a decode graph reads (RoundGraphs serves those)."""
        return (step.slots is self.pool.slots and step.bucket is not None and step.plan.draft_step is None
                and graph_key(step) in self.graphs)

    def graph_for(self, step: DeviceStep) -> torch.cuda.CUDAGraph:
        """The captured graph that serves `step` (benchmarks time its replay alone); PlanError if none does."""
        if not self.serves(step):
            raise PlanError(f"DecodeGraphs.graph_for: no captured graph serves this step (key {graph_key(step)})")
        return self.graphs[graph_key(step)][0]

    def __call__(self, step: DeviceStep, **inputs: torch.Tensor) -> torch.Tensor:
        """fn(step, inputs), replayed when a graph serves the step; returns [plan.num_tokens, ...] rows."""
        if not isinstance(step, DeviceStep):
            raise PlanError(f"DecodeGraphs: step must be a DeviceStep, got {type(step).__name__}")
        if step.slots is not self.pool.slots:
            raise PlanError("DecodeGraphs: the step was committed to another pool than the one these graphs read")
        step.check("DecodeGraphs", launch=False)  # (a deferred commit's work: run below, in the graph if it can be)
        if step.plan.draft_step is not None:
            raise PlanError("DecodeGraphs: this step is part of a draft round (commit_round); replay rounds with "
                            "RoundGraphs, or run its steps eagerly")
        if not self.serves(step):
            return self.fn(step, inputs)
        if inputs.keys() != self.inputs.keys():
            raise PlanError(f"DecodeGraphs: inputs {sorted(inputs)} differ from the captured {sorted(self.inputs)}")
        key = graph_key(step)
        graph, out = self.graphs[key]
        for name, t in inputs.items():
            buf = self.inputs[name]
            if not isinstance(t, torch.Tensor) or t.dtype != buf.dtype or t.device != buf.device or t.shape[1:] != buf.shape[1:]:
                raise PlanError(f"DecodeGraphs: inputs[{name!r}] must be [rows, {', '.join(map(str, buf.shape[1:]))}] "
                                f"{buf.dtype} on {buf.device} like the captured buffer, got "
                                + (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
            if not step.accepts_rows(t.shape[0]):
                raise PlanError(f"DecodeGraphs: inputs[{name!r}] has {t.shape[0]} rows; this step takes {step.rows_expected()}")
        for name, t in inputs.items():
            self.inputs[name][: t.shape[0]].copy_(t)
        work = self.pool.device_work
        pending = work.pending_key(step.slot, step.generation)
        if pending is not None:
            key = (*key, pending[0])  # (the folded graph of this kind of commit work: derived or listed)
            full = self.prepared.get(key)
            if full is not None:  # the commit's work, then the forward: one launch
                work.taken(step.slot)
                graph, out = full
            else:  # the key's first deferred step: its work launched alone, then that graph captured for next time
                work.launch(step.slot, "DecodeGraphs")
                graph.replay()
                self.prepared[key] = self._capture_prepared(step, work.works[pending])
                return out[: step.plan.num_tokens]
        graph.replay()
        return out[: step.plan.num_tokens]

    def _capture_prepared(self, step: DeviceStep, commit_work) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of commit_work (the step's commit's device work, captured, not run) then fn on the
        step: every kernel it launches has run by now (the forward graph's warm-up, the commit's work)."""
        static = {name: t[: step.padded_num_tokens] for name, t in self.inputs.items()}
        graph = torch.cuda.CUDAGraph()

        def both():
            commit_work()
            return self.fn(step, static)

        return graph, capture_into(graph, self.memory, both)


class RoundGraphs:
    """fn(steps, inputs) -> Tensor, a whole draft round (K committed steps, pool.commit_round)
    captured as one CUDA graph per (pool slot, bucket, K, backend).

    fn runs the K steps of the round itself, with whatever it does between them on the device
    (sampling each step's token and feeding it to the next): inputs are static device buffers,
    each [max bucket, ...] (a round's rows are its requests); a call copies the live inputs into
    their first rows and replays. Rounds the pool does not bucket (past the largest bucket) and
    uncaptured K run fn eagerly. The output is valid until the next replay of this RoundGraphs.
    Capture records on `scratch_round` rounds, which touch only the scratch page.
    """

    def __init__(self, pool: GraphBufferPool, fn: Callable[[tuple[DeviceStep, ...], dict], torch.Tensor],
                 inputs: dict[str, torch.Tensor]):
        self.decode = DecodeGraphs(pool, fn, inputs)  # (its checks, inputs and memory pool; its fn takes the steps)
        self.pool, self.fn, self.inputs = pool, fn, self.decode.inputs
        self.graphs: dict[tuple[int, int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # graph replays, one per round served

    def capture(self, k: int, buckets: tuple[int, ...] | None = None, backends: tuple[str, ...] | None = None) -> None:
        """Capture rounds of k steps for every (bucket, backend, slot); defaults as DecodeGraphs.capture."""
        pool, spec = self.pool, self.pool.spec
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= pool.max_draft_steps:
            raise PlanError(f"RoundGraphs.capture: k {k!r} is not a round this pool holds (1..max_draft_steps "
                            f"{pool.max_draft_steps})")
        buckets = tuple(pool.buckets if buckets is None else buckets)
        if backends is None:
            backends = (spec.backend,) if spec.backend != AUTO else graph_backends(spec)
        self.decode._check_capture(buckets, (1,), tuple(backends))
        if self.decode.memory is None:
            self.decode.memory = torch.cuda.graph_pool_handle()
        for bucket, backend, slot in itertools.product(buckets, backends, range(pool.num_slots)):
            steps = pool.commit_round(scratch_round(spec, bucket, k, backend=backend), slot=slot)
            static = {name: t[:bucket] for name, t in self.inputs.items()}
            self.graphs[(slot, bucket, k, backend)] = _record(self.fn, steps, static, self.decode.memory)
        torch.cuda.synchronize()

    def serves(self, steps: tuple[DeviceStep, ...]) -> bool:
        s = steps[0]
        return s.slots is self.pool.slots and s.bucket is not None and (s.slot, s.bucket, len(steps), s.plan.backend) in self.graphs

    def __call__(self, steps: tuple[DeviceStep, ...], **inputs: torch.Tensor) -> torch.Tensor:
        """fn(steps, inputs), replayed when a graph serves the round; returns the output's first B rows."""
        if not isinstance(steps, tuple) or not steps or not all(isinstance(s, DeviceStep) for s in steps):
            raise PlanError("RoundGraphs: steps must be the tuple of DeviceSteps pool.commit_round returned")
        if steps[0].slots is not self.pool.slots:
            raise PlanError("RoundGraphs: the round was committed to another pool than the one these graphs read")
        for s in steps:
            s.check("RoundGraphs")
        B = steps[0].plan.batch_size
        if not self.serves(steps):
            return self.fn(steps, inputs)
        if inputs.keys() != self.inputs.keys():
            raise PlanError(f"RoundGraphs: inputs {sorted(inputs)} differ from the captured {sorted(self.inputs)}")
        graph, out = self.graphs[(steps[0].slot, steps[0].bucket, len(steps), steps[0].plan.backend)]
        for name, t in inputs.items():
            buf = self.inputs[name]
            if (not isinstance(t, torch.Tensor) or t.dtype != buf.dtype or t.device != buf.device
                    or t.shape[1:] != buf.shape[1:] or not B <= t.shape[0] <= steps[0].padded_batch_size):
                raise PlanError(f"RoundGraphs: inputs[{name!r}] must be [{B}..{steps[0].padded_batch_size}, "
                                f"{', '.join(map(str, buf.shape[1:]))}] {buf.dtype} on {buf.device}")
        for name, t in inputs.items():
            self.inputs[name][: t.shape[0]].copy_(t)
        graph.replay()
        self.replays += 1
        return out[:B]
