"""What the model and the KV cache look like: fixed for the life of an engine."""

from __future__ import annotations

import enum

import attrs
import torch


class PlanError(ValueError):
    """Malformed step input, raised by `build_plan` or `GraphBufferPool.commit`.

    The message names the field and, where there is one, the request index.
    """


class Kind(enum.Enum):
    CAUSAL = "causal"  # full causal attention, queries at the end of the sequence
    WINDOW = "window"  # causal, each query sees only the last `window` keys (itself included)
    NONCAUSAL = "noncausal"  # every query sees every key of its request


def _positive(inst, attribute, value):
    if value <= 0:
        raise PlanError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class LayerGroup:
    """Layers that share one attention pattern (and therefore one kernel plan).

    `window` is W for Kind.WINDOW: a query at position p sees keys p-W+1 .. p
    (FlashInfer's window_left = W - 1, FlashAttention's window_size = (W - 1, 0)).
    """

    kind: Kind = attrs.field(default=Kind.CAUSAL, converter=Kind)
    window: int | None = None

    def __attrs_post_init__(self):
        if (self.kind is Kind.WINDOW) != (self.window is not None):
            raise PlanError(f"LayerGroup.window is set iff kind is 'window' (kind={self.kind.value}, window={self.window})")
        if self.window is not None and self.window < 1:
            raise PlanError(f"LayerGroup.window must be >= 1, got {self.window}")

    @property
    def causal(self) -> bool:
        return self.kind is not Kind.NONCAUSAL

    @property
    def window_left(self) -> int:
        """Keys left of the query a query may see; -1 means unbounded (FlashInfer's convention)."""
        return -1 if self.window is None else self.window - 1


@attrs.frozen
class AttentionSpec:
    """Model and cache shape. `layer_groups[i]` is the index into `groups` of layer i.

    dtype is the dtype of q, k, v and the KV cache. sm_scale defaults to head_dim ** -0.5;
    soft_cap = 0 disables logit soft-capping (otherwise logits become cap * tanh(logits / cap)).
    """

    num_qo_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    page_size: int = attrs.field(validator=_positive)
    num_pages: int = attrs.field(validator=_positive)
    dtype: torch.dtype = torch.bfloat16
    sm_scale: float = attrs.field()
    soft_cap: float = 0.0
    groups: tuple[LayerGroup, ...] = attrs.field(default=(LayerGroup(),), converter=tuple)
    layer_groups: tuple[int, ...] = attrs.field(default=(0,), converter=tuple)
    backend: str = "flashinfer"  # a kernels.BACKENDS name, or "auto": build_plan picks per step

    @sm_scale.default
    def _default_scale(self):
        return self.head_dim**-0.5

    def __attrs_post_init__(self):
        if self.num_qo_heads % self.num_kv_heads:
            raise PlanError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.groups:
            raise PlanError("groups must name at least one LayerGroup")
        bad = [i for i, g in enumerate(self.layer_groups) if not 0 <= g < len(self.groups)]
        if bad:
            raise PlanError(f"layer_groups[{bad[0]}] = {self.layer_groups[bad[0]]} is not a group index (0..{len(self.groups) - 1})")
        if self.soft_cap < 0:
            raise PlanError(f"soft_cap must be >= 0 (0 disables it), got {self.soft_cap}")
        from mstar_attn.kernels import AUTO, BACKENDS  # plain data; imports no GPU package

        if self.backend != AUTO and self.backend not in BACKENDS:
            raise PlanError(f"spec.backend: unknown backend {self.backend!r} (known: {sorted(BACKENDS)} or {AUTO!r})")
        name = "flashinfer" if self.backend == AUTO else self.backend  # auto falls back to FlashInfer paged
        BACKENDS[name].check(self, name)

    @property
    def gqa_group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def group_of(self, layer: int) -> int:
        return self.layer_groups[layer]
