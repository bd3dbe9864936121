"""Attention as `torch.library` custom ops, so a `torch.compile`d model keeps its attention layers in
one graph (`fullgraph=True`, no graph break) and CUDA graphs capture the compiled step.

    torch.ops.mstar_attn.forward(q, k, v, key, attend_only=False) -> out
                                      store k, v and attend (Attention.forward), or attend only
                                      (Attention.attend): what Attention calls without a step
    torch.ops.mstar_attn.attention(q, k, v, out, key, attend_only=False)
                                      the same, writing into a preallocated out
    torch.ops.mstar_attn.store(k, v, key)               store k, v only (a layer that splits the two)

`key` names the `Attention` layer (its cache, layer group and spec: `Attention.key`); the step comes
from `step_context(step)`, which the engine enters around each forward:

    with mstar_attn.step_context(step):        # step: the committed DeviceStep (or, reference: a plan)
        logits = compiled_model(ids, positions)  # its layers call Attention.forward(q, k, v) (no step)

Why this shape (docs/architecture.md, "Compiled models"): a DeviceStep is a host object, not a
tensor; as an argument of a compiled function it would be a guard (a recompile per step). Dynamo
does not trace into a custom op's implementation, so the op may read the step from the context,
as vLLM's unified attention op reads its forward context. The KV caches are not op arguments: as
mutable arguments, functionalization would clone a whole cache per layer wherever Inductor cannot
re-inplace it (and the eager `aot_eager` path always does). They are mutated behind the ops, like
vLLM's, and ordering holds because every layer's attention output feeds the next layer; every op
is registered as a side effect: Inductor (torch 2.13) keeps an attention call whose output nothing reads
(tests/test_ops.py pins it), and orders a separate `store` before `attend` by program order only: prefer
`forward(q, k, v)` over a split store + attend inside a compiled model. `forward` returns the backend's
output as it is (no output buffer to allocate, no copy into one: the cheaper call, what Attention uses);
`attention` writes into a preallocated `out`, its one declared mutation (Tensor(a!)), as vLLM's op does.

The implementations run `Attention.forward` / `Attention.store` with the context's step, so every
check of the direct call runs and bad input raises the same PlanError, at run time (the fake
implementations only give shapes). Registered with `torch.library.define` + `impl` (a cheaper
dispatch than the `@custom_op` decorator).
"""

from __future__ import annotations

import contextlib
import itertools
import contextvars
import weakref
from typing import Iterator

import torch

from mstar_attn.metadata.errors import PlanError

_LIB = torch.library.Library("mstar_attn", "DEF")  # noqa: TOR901  (held for the process: the ops stay registered)
_LIB.define("forward(Tensor q, Tensor? k, Tensor? v, int key, bool attend_only=False) -> Tensor")
_LIB.define("attention(Tensor q, Tensor? k, Tensor? v, Tensor(a!) out, int key, bool attend_only=False) -> ()")
_LIB.define("store(Tensor k, Tensor v, int key) -> ()")

_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> Attention (the ops' layers)
_keys = itertools.count()
# the step of the forward in progress (step_context): a context variable, so each thread and each asyncio task
# (an engine serving two pools from two threads, or from two tasks of one event loop) sees only its own
_STEP: contextvars.ContextVar = contextvars.ContextVar("mstar_attn_step", default=None)
# the forward's padded token rows (step_context(step, padded_rows=n)), or None
_PADDED: contextvars.ContextVar = contextvars.ContextVar("mstar_attn_padded_rows", default=None)


def register(layer) -> int:
    """A fresh key for `layer` (an Attention), by which the ops find it; held weakly."""
    key = next(_keys)
    _layers[key] = layer
    return key


@contextlib.contextmanager
def step_context(step, padded_rows: int | None = None) -> Iterator:
    """The step the mstar_attn ops of a forward run with: a committed DeviceStep (or, on the reference
    backend, an AttentionPlan). Enter it around the model's forward, eager, compiled or being captured
    into a CUDA graph; contexts nest (the inner step wins until it exits) and belong to their thread and
    asyncio task (an engine serving two pools from two threads or two tasks gives each its own).

    padded_rows: the forward's inputs are padded to this many token rows (at least the step's tokens), as a
    piecewise-compiled forward replaying its pieces per token-count bucket is (mstar_attn.piecewise): the ops
    then take q, k, v of padded_rows rows, store and attend the step's rows only (its tokens, or a bucketed
    step's padded batch) and write zeros past them; the compiled pieces key their CUDA graphs on it. None:
    the rows must be the step's (DeviceStep.accepts_rows)."""
    if padded_rows is not None:
        rows = _step_rows(step)
        if isinstance(padded_rows, bool) or not isinstance(padded_rows, int) or padded_rows < rows:
            raise PlanError(f"step_context: padded_rows must be an int of at least the step's {rows} token rows, "
                            f"got {padded_rows!r}")
    before, padded_before = _STEP.get(), _PADDED.get()
    token, padded_token = _STEP.set(step), _PADDED.set(padded_rows)
    try:
        yield step
    finally:
        try:
            _STEP.reset(token)
            _PADDED.reset(padded_token)
        except ValueError:  # (a generator suspended inside the context and finished in another one)
            _STEP.set(before)
            _PADDED.set(padded_before)


def padded_rows() -> int | None:
    """The padded token rows of the enclosing step_context (None: not padded, or outside one)."""
    return _PADDED.get()


def _step_rows(step) -> int:
    """The token rows a step's kernels take: a bucketed DeviceStep's padded rows, else its plan's tokens."""
    shape = getattr(step, "shape", None)
    if shape is not None:
        return shape.padded_num_tokens if shape.bucket is not None else step.plan.num_tokens
    n = getattr(step, "num_tokens", None)
    if not isinstance(n, int):
        raise PlanError(f"step_context: step must be a DeviceStep or an AttentionPlan, got {type(step).__name__}")
    return n


def current_step(where: str):
    """The step of the enclosing step_context; PlanError outside one."""
    step = _STEP.get()
    if step is None:
        raise PlanError(f"{where}: no step: call the layer with forward(q, k, v, step), or run the model inside "
                        "`with mstar_attn.step_context(step):`")
    return step


def _layer(key: int, where: str):
    layer = _layers.get(int(key))
    if layer is None:
        raise PlanError(f"{where}: no mstar_attn.Attention layer has key {key} (its object was deleted, or the key "
                        "is not an Attention.key)")
    return layer


def _forward(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, key: int,
             attend_only: bool = False) -> torch.Tensor:
    """mstar_attn.forward: layer `key`'s forward (or attend) with the step of step_context; q [rows, qo_heads,
    head_dim (+ rope dims: MLA)], k, v [rows, kv_heads, ...] (a cross layer: the encoder tokens it stores) ->
    a new [rows, qo_heads, head_dim] tensor of q's dtype on q's device (rows past a padded forward's step rows:
    zeros)."""
    layer, step = _layer(key, "mstar_attn.forward"), current_step("mstar_attn.forward")
    return _run(layer, step, q, k, v, attend_only, "mstar_attn.forward")


def _run(layer, step, q: torch.Tensor, k, v, attend_only: bool, where: str) -> torch.Tensor:
    """layer.forward(q, k, v, step) (or attend(q, step)); a padded forward's q, k, v cut to the step's rows and
    the result padded back with zeros (what both attention ops return or write)."""
    rows = q.shape[0]
    n = _real_rows(rows, step, where)
    if n == rows:
        return layer.attend(q, step) if attend_only else layer.forward(q, k, v, step)
    q, k, v = q[:n], _rows(k, n, layer), _rows(v, n, layer)  # (padded rows: the step's rows only, zeros past them)
    out = layer.attend(q, step) if attend_only else layer.forward(q, k, v, step)
    return torch.cat([out, out.new_zeros((rows - n, *out.shape[1:]))])


def _forward_fake(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, key: int,
                  attend_only: bool = False) -> torch.Tensor:
    """Fake (meta) implementation: the layer's output shape (Attention.out_shape), q's dtype and device."""
    return q.new_empty(_layer(key, "mstar_attn.forward").out_shape(q.shape[0]))


def _attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor, key: int,
               attend_only: bool = False) -> None:
    layer, step = _layer(key, "mstar_attn.attention"), current_step("mstar_attn.attention")
    want = layer.out_shape(q.shape[0])
    if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:  # (before any work)
        raise PlanError(f"mstar_attn.attention: out is {tuple(out.shape)} {out.dtype} on {out.device}; layer "
                        f"{layer.layer} writes {want} {q.dtype} on {q.device}")
    out.copy_(_run(layer, step, q, k, v, attend_only, "mstar_attn.attention"))


def _store(k: torch.Tensor, v: torch.Tensor, key: int) -> None:
    layer, step = _layer(key, "mstar_attn.store"), current_step("mstar_attn.store")
    n = _real_rows(k.shape[0], step, "mstar_attn.store")
    if n < k.shape[0]:  # (padded rows: the step's rows only)
        k, v = _rows(k, n, layer), _rows(v, n, layer)
    layer.store(k, v, step)


def _real_rows(rows: int, step, where: str) -> int:
    """The rows of a padded forward's tensors that the step takes (the step's rows when `rows` is the
    step_context's padded_rows and past them), else `rows` (the direct call checks them)."""
    padded = _PADDED.get()
    if padded is None or rows != padded:
        return rows
    return min(rows, _step_rows(step))


def _rows(t: torch.Tensor | None, n: int, layer) -> torch.Tensor | None:
    """t's first n rows (k, v of a padded forward); a cross-attention layer's encoder tokens as they are."""
    if t is None or layer.spec.groups[layer.group].cross:
        return t
    return t[:n]


def _nothing(*args) -> None:
    """Fake (meta) implementation: the ops return nothing and `out` keeps its shape and dtype."""
    return None


_LIB.impl("forward", _forward, "CompositeExplicitAutograd")
_LIB.impl("attention", _attention, "CompositeExplicitAutograd")
_LIB.impl("store", _store, "CompositeExplicitAutograd")
torch.library.register_fake("mstar_attn::forward", _forward_fake, lib=_LIB)
torch.library.register_fake("mstar_attn::attention", _nothing, lib=_LIB)
torch.library.register_fake("mstar_attn::store", _nothing, lib=_LIB)
torch.fx.node.has_side_effect(torch.ops.mstar_attn.forward.default)
torch.fx.node.has_side_effect(torch.ops.mstar_attn.store.default)
torch.fx.node.has_side_effect(torch.ops.mstar_attn.attention.default)

