"""Piecewise compilation: a model's step forward compiled with its graph split at the attention ops.

    forward = mstar_attn.compile_piecewise(model_forward)    # torch.compile(fullgraph=True, dynamic=True)
    with mstar_attn.step_context(step):
        logits = forward(ids, positions)                     # its layers call Attention.forward(q, k, v)
    with mstar_attn.step_context(step, padded_rows=n):      # ids, positions padded to n rows (a bucket)
        logits = forward(ids_n, positions_n)[:T]             # the pieces replay CUDA graphs captured for n

Dynamo captures the whole forward as one graph (no graph break: attention is the mstar_attn custom ops,
mstar_attn.ops), with the token count symbolic. `piecewise_backend` then splits that graph at every
`mstar_attn.forward` / `attention` / `store` call (torch.fx's split_module): each attention call becomes a
piece of its own that runs as it is (the op reads the committed step of `step_context`, whatever its
mode: decode, mixed, prefill), and every piece between two attention calls is compiled by Inductor for
any token count (two compiles: Dynamo specializes a one-token step). This is vLLM's piecewise mode: the
pieces around attention are captured as CUDA graphs per token-count bucket, so that mixed and prefill steps,
whose attention cannot be captured with its metadata, still replay everything else.

Graphs per bucket: an engine pads the forward's inputs to a bucket of n token rows and says so with
`step_context(step, padded_rows=n)`. On CUDA each compiled piece then captures a CUDA graph at its first call
for that n (after one warm-up run) and replays it at every later one; the attention ops between them run
eagerly on the step's own rows and write zeros past them (mstar_attn.ops). A piece's graph reads its inputs
where the capture found them: model parameters and the outputs of other piece graphs are read in place,
any other tensor input (the padded ids, a buffer, an attention output) is cloned at capture; before each replay
an input other than a parameter that a call passes elsewhere is copied in (the same shape, else PlanError; a
graph's outputs live as long as it does, so copying into another graph's output is safe). A piece with a CPU
tensor input other than a 0-dim scalar is not captured. A piece's graphs are keyed by n, by the sizes it takes as
arguments, by the addresses of the parameters it reads in place (another model's weights, or reloaded ones, get
graphs of their own) and by the values of its CPU scalars; at most MAX_VARIANTS per n and sizes (past them, and
for a scalar that changes every call, the piece runs as compiled). A piece that writes into one of its inputs
(`mutates_inputs`, or the fake inputs' version counters at compile time) is never captured: it runs as compiled.
All graphs of one compiled function share one memory pool and its static inputs and outputs: one thread runs it
at a time, and a padded forward's outputs are valid until the next padded forward (a later capture may reuse
their memory: read the logits before the next forward). Pieces capture at their first call for an n, during
serving: run each bucket once before serving. Without padded_rows (or on the CPU, or inside a capture of
the whole forward) the pieces run as compiled. `STATS` counts the piece graphs captured and replayed.

How the pieces get compiled: the split graph is run once under Dynamo's fake tensor mode (a
torch.fx.Interpreter), which hands each non-attention piece its fake inputs, symbolic shapes included;
`torch._inductor.compile_fx.compile_fx` compiles it from them. Those two torch entry points (and
torch._guards.detect_fake_mode, and tensors' `_version` counters) are the torch internals this module relies on;
tests/test_piecewise.py fails when they move.
"""

from __future__ import annotations

import operator
import warnings
from typing import Callable

import torch

from mstar_attn import ops  # (registers the ops the split looks for)
from mstar_attn.capture.graph_cache import capture_into
from mstar_attn.metadata.errors import PlanError

ATTENTION_OPS = (torch.ops.mstar_attn.forward, torch.ops.mstar_attn.attention, torch.ops.mstar_attn.store)
_MISSING = object()
MAX_VARIANTS = 4  # graphs per piece and (padded_rows, sizes) that differ in parameters or CPU scalars; past them: compiled
STATS = {"captured": 0, "replayed": 0}  # piece graphs captured and replayed in this process (all compiled functions)
_TARGETS = frozenset([*ATTENTION_OPS, *(op.default for op in ATTENTION_OPS)])


def is_attention(node: torch.fx.Node) -> bool:
    """Whether an FX node calls one of the mstar_attn attention ops (overload packet or overload)."""
    return node.op == "call_function" and node.target in _TARGETS


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """gm split into pieces in program order: each attention call a piece of its own, every run of other
    nodes between two of them one piece. Returns the split module and the names of its attention pieces."""
    from torch.fx.passes.split_module import split_module

    part, at = {}, 0
    for node in gm.graph.nodes:
        if is_attention(node):
            part[node], at = at + 1, at + 2
        else:
            part[node] = at
    split = split_module(gm, None, lambda node: part[node], keep_original_order=True)
    attention = [n.target for n in split.graph.nodes if n.op == "call_module"
                 and any(is_attention(m) for m in getattr(split, n.target).graph.nodes)]
    return split, attention


_VIEWS = frozenset({"view", "reshape", "narrow", "__getitem__", "transpose", "permute", "squeeze", "unsqueeze", "expand",
                    "flatten", "t", "select", "unflatten", "view_as", "split", "chunk", "unbind", "as_strided"})
_INPLACE = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem})


def mutates_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether the piece `gm` writes into one of its inputs or a view of one (an in-place method, an in-place
    operator, an op whose schema writes an argument): such a piece is not captured (a graph replay would apply
    the write to inputs it reads in place twice, and never to those it cloned)."""

    seen = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if n.op == "call_method" and first in seen:
            if n.target in _VIEWS:
                seen.add(n)
            elif n.target.endswith("_") and not n.target.endswith("__"):
                return True
        elif n.op == "call_function":
            if n.target is operator.getitem and first in seen:
                seen.add(n)
            elif n.target in _INPLACE and first in seen:
                return True
            schema = getattr(n.target, "_schema", None)
            if schema is not None and any(a.alias_info is not None and a.alias_info.is_write and arg in seen
                                          for a, arg in zip(schema.arguments, n.args)):
                return True
    return False


def new_graph():
    """A new CUDA graph for one piece and key."""
    return torch.cuda.CUDAGraph()


class CaptureFailed(RuntimeError):
    """A piece's CUDA graph capture raised (after its warm-up ran: the piece itself works)."""


class _PieceGraph:
    """One compiled piece captured as a CUDA graph for one padded token count: its static inputs (a model
    parameter, or another piece graph's output, as given; any other tensor cloned) and outputs."""

    def __init__(self, fn: Callable, args: tuple, memory, outputs: set):
        self.inputs = [a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
                       and a.data_ptr() not in outputs else a for a in args]
        # (every input but a parameter: copied in when a call passes it elsewhere, another graph's output too)
        self.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)]
        fn(*self.inputs)  # (warm-up, outside the capture: lazy allocations, autotuning)
        self.graph = new_graph()
        try:  # (capture errors of this thread only: other threads may serve other pools meanwhile)
            self.out = capture_into(self.graph, memory, lambda: fn(*self.inputs), "thread_local")
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise CaptureFailed(str(e)) from e
        outputs.update(t.data_ptr() for t in output_tensors(self.out))

    def __call__(self, args: tuple):
        """Replay on `args`: an input other than a parameter copied in first when the call passes it elsewhere
        than the capture read it (PlanError if its shape is not the capture's: the piece's inputs change shape
        at one padded_rows)."""
        for i in self.copied:
            a, s = args[i], self.inputs[i]
            if a.data_ptr() != s.data_ptr():
                if a.shape != s.shape:
                    raise PlanError(f"piecewise: input {i} of a piece is {tuple(a.shape)}, its graph for this "
                                    f"padded_rows took {tuple(s.shape)}: pad every per-step input to padded_rows rows")
                s.copy_(a)
        self.graph.replay()
        return self.out


def capturable(args: tuple) -> bool:
    """Whether a piece called on `args` can be captured: CUDA tensors, and CPU 0-dim scalars (a module's float
    attribute Dynamo lifted: its value is baked into the graph's launches, so it is part of the graph's key)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and any(a.is_cuda for a in tensors) and all(a.is_cuda or a.dim() == 0 for a in tensors)


def versions(args) -> list[int]:
    """The version counters of the tensors among `args` (torch bumps one at every in-place write to the tensor
    or a view of it, in any form: a method, an operator, an out= argument, inplace=True)."""
    return [a._version for a in args if isinstance(a, torch.Tensor)]


def new_pool():
    """The memory pool a compiled function's piece graphs share."""
    return torch.cuda.graph_pool_handle()


def output_tensors(out) -> list[torch.Tensor]:
    """The tensors of a piece's output (one tensor, or a tuple of them and other values)."""
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


class _Compiled(torch.nn.Module):
    """A compiled piece in the split module's place of the original one (the split graph calls modules). In a
    forward padded to n token rows on CUDA (step_context(step, padded_rows=n)) it replays the CUDA graph it
    captured at its first such call (one per n; all of a compiled function's in one memory pool), else it runs."""

    def __init__(self, fn: Callable, shared: dict, graphs: bool = True):
        super().__init__()
        self.fn, self.shared, self.graphs, self.graphable = fn, shared, {}, graphs
        self.keyed = None  # (positions of the int arguments, the parameters, the CPU scalars: fixed per piece)
        self.variants: dict[tuple, int] = {}  # (padded_rows, sizes) -> graphs captured for it (at most MAX_VARIANTS)

    def key(self, n: int, args: tuple) -> tuple:
        """A graph's key: n, the sizes the piece takes as arguments, the addresses of the parameters it reads in
        place (another model's, or reloaded weights: another graph, never this one's), the CPU scalars' values."""
        if self.keyed is None:
            self.keyed = ([i for i, a in enumerate(args) if isinstance(a, int)],
                          [i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)],
                          [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_cuda and a.dim() == 0])
        ints, params, scalars = self.keyed
        return (n, *(args[i] for i in ints), *(args[i].data_ptr() for i in params), *(args[i].item() for i in scalars))

    def forward(self, *args):
        n = ops.padded_rows()
        if n is None or not self.graphable or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return self.fn(*args)  # (inside a capture of the whole forward: captured with it)
        n = self.key(n, args)
        graph = self.graphs.get(n, _MISSING)
        if graph is None:  # (its capture failed: runs as compiled)
            return self.fn(*args)
        if graph is _MISSING:
            shape = n[: 1 + len(self.keyed[0])]  # (padded_rows and the sizes: other weights or scalars are variants)
            if not capturable(args) or self.variants.get(shape, 0) >= MAX_VARIANTS:
                return self.fn(*args)  # (a scalar that changes every call, models past MAX_VARIANTS: compiled)
            self.variants[shape] = self.variants.get(shape, 0) + 1
            if self.shared["memory"] is None:
                self.shared["memory"] = new_pool()
            try:
                graph = self.graphs[n] = _PieceGraph(self.fn, args, self.shared["memory"], self.shared["outputs"])
            except CaptureFailed as e:  # (never tried again for this key: a warning, then the compiled piece)
                self.graphs[n] = None
                warnings.warn(f"piecewise: a piece's CUDA graph for padded_rows {n[0]} did not capture ({e}); "
                              "it runs as compiled", RuntimeWarning, 2)
                return self.fn(*args)
            STATS["captured"] += 1
        STATS["replayed"] += 1
        return graph(args)


def piecewise_backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """A torch.compile backend: gm split at the attention ops (split_at_attention), each other piece
    compiled by Inductor from its fake inputs; the attention pieces run as they are. Returns the split
    module, which Dynamo calls with the real inputs at every step."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensor

    split, attention = split_at_attention(gm)
    compiled: dict[str, Callable] = {}
    graphable: dict[str, bool] = {}

    class Compile(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            before = versions(args)
            out = super().call_module(target, args, kwargs)
            if target not in attention:  # (a piece that wrote into an input, in any form: never captured)
                graphable[target] = not mutates_inputs(self.fetch_attr(target)) and versions(args) == before
                compiled[target] = compile_fx(self.fetch_attr(target), list(args))
            return out

    from torch._dispatch.python import enable_python_dispatcher

    fake = detect_fake_mode(example_inputs)
    args = [fake.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
            for a in example_inputs]  # (Dynamo's fake inputs; module attributes it lifted come real)
    with fake, enable_python_dispatcher():  # (some SymInt decompositions need the Python dispatcher)
        Compile(split).run(*args)
    shared = {"memory": None, "outputs": set()}  # the pieces' graph memory pool; their graphs' output addresses
    for target, fn in compiled.items():
        setattr(split, target, _Compiled(fn, shared, graphable[target]))
    return split


def compile_piecewise(fn: Callable) -> Callable:
    """fn through torch.compile with piecewise_backend: one Dynamo graph (fullgraph=True: a graph break is
    an error), sizes symbolic (dynamic=True): one compile serves every step of two or more tokens, and one
    more the one-token steps (Dynamo specializes size 1)."""
    return torch.compile(fn, backend=piecewise_backend, fullgraph=True, dynamic=True)
