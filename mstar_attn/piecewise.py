"""Piecewise compilation: a model's step forward compiled with its graph split at the attention ops.

    forward = mstar_attn.compile_piecewise(model_forward)    # torch.compile(fullgraph=True, dynamic=True)
    with mstar_attn.step_context(step):
        logits = forward(ids, positions)                     # its layers call Attention.forward(q, k, v)

Dynamo captures the whole forward as one graph (no graph break: attention is the mstar_attn custom ops,
mstar_attn.ops), with the token count symbolic. `piecewise_backend` then splits that graph at every
`mstar_attn.attention` / `mstar_attn.store` call (torch.fx's split_module): each attention call becomes a
piece of its own that runs as it is (the op reads the committed step of `step_context`, whatever its
mode: decode, mixed, prefill), and every piece between two attention calls is compiled by Inductor for
any token count (two compiles: Dynamo specializes a one-token step). This is vLLM's piecewise mode: the pieces around attention are what an engine captures as
CUDA graphs per token-count bucket, so that mixed and prefill steps, whose attention cannot be captured
with its metadata, still replay everything else. Capturing the pieces per bucket is not part of this module
yet: here the compiled pieces run eagerly between the attention calls.

How the pieces get compiled: the split graph is run once under Dynamo's fake tensor mode (a
torch.fx.Interpreter), which hands each non-attention piece its fake inputs, symbolic shapes included;
`torch._inductor.compile_fx.compile_fx` compiles it from them. Those two torch entry points (and
torch._guards.detect_fake_mode) are the torch internals this module relies on; tests/test_piecewise.py
fails when they move.
"""

from __future__ import annotations

from typing import Callable

import torch

from mstar_attn import ops  # noqa: F401  (registers the ops the split looks for)

ATTENTION_OPS = (torch.ops.mstar_attn.attention, torch.ops.mstar_attn.store)
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


class _Compiled(torch.nn.Module):
    """A compiled piece in the split module's place of the original one (the split graph calls modules)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def piecewise_backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """A torch.compile backend: gm split at the attention ops (split_at_attention), each other piece
    compiled by Inductor from its fake inputs; the attention pieces run as they are. Returns the split
    module, which Dynamo calls with the real inputs at every step."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensor

    split, attention = split_at_attention(gm)
    compiled: dict[str, Callable] = {}

    class Compile(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            out = super().call_module(target, args, kwargs)
            if target not in attention:
                compiled[target] = compile_fx(self.fetch_attr(target), list(args))
            return out

    from torch._dispatch.python import enable_python_dispatcher

    fake = detect_fake_mode(example_inputs)
    args = [fake.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
            for a in example_inputs]  # (Dynamo's fake inputs; module attributes it lifted come real)
    with fake, enable_python_dispatcher():  # (some SymInt decompositions need the Python dispatcher)
        Compile(split).run(*args)
    for target, fn in compiled.items():
        setattr(split, target, _Compiled(fn))
    return split


def compile_piecewise(fn: Callable) -> Callable:
    """fn through torch.compile with piecewise_backend: one Dynamo graph (fullgraph=True: a graph break is
    an error), sizes symbolic (dynamic=True): one compile serves every step of two or more tokens, and one
    more the one-token steps (Dynamo specializes size 1)."""
    return torch.compile(fn, backend=piecewise_backend, fullgraph=True, dynamic=True)
