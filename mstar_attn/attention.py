"""`Attention`: what one attention layer of an engine's model holds, the way vLLM's, SGLang's and
nano-vllm's layers do: its spec, its layer index (so its layer group) and its KV cache.
`forward(q, k, v, step)` stores the step's new K/V in the cache and attends; `store` and `attend`
are the two halves for layers that split them (a fused RoPE + store, cross attention).

    pool = GraphBufferPool(spec, PoolLimits(...))              # the one stateful place
    layers = Attention.for_model(spec, device)                 # one per model layer, caches allocated
    step = pool.commit(build_plan(batch, spec), defer=True)    # per engine step
    out = layers[i].forward(q, k, v, step)                     # inside layer i's forward

It works eagerly and inside captured graphs (DecodeGraphs records a forward that calls it); all it
does is `write_kv` and `run` with the layer's group and cache. Called without a step, it goes through
the custom ops of mstar_attn.ops and reads the step of the enclosing `step_context(step)`: the form a
`torch.compile`d model uses (no graph break at attention).
"""

from __future__ import annotations

import torch

from mstar_attn import kernels, ops
from mstar_attn.cache import PagedKVCache, default_device
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.spec import AttentionSpec


class Attention:
    """Layer `layer` of a model with AttentionSpec `spec`, over `cache` (a PagedKVCache fitting the spec,
    tagged with the layer's group or untagged; PlanError otherwise, naming what differs). sinks: the
    layer's attention sinks (gpt-oss), float32 [num_qo_heads] on the cache's device, required where its
    group has them (LayerGroup.sinks) and refused where it has none; run reads them at every call (the
    tensor is held, not copied: a captured graph reads the values it holds at replay)."""

    def __init__(self, spec: AttentionSpec, layer: int, cache: PagedKVCache, sinks: torch.Tensor | None = None):
        if not isinstance(spec, AttentionSpec):
            raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        self.group = spec.group_of(layer)  # (PlanError for what is not a layer index, or past layer_groups)
        self.spec, self.layer = spec, int(layer)
        if not isinstance(cache, PagedKVCache):
            raise PlanError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        cache.check(spec, f"layer {layer}: cache", self.group)
        self.cache = cache
        self.sinks = self._sinks(sinks)
        self.key = ops.register(self)  # how the custom ops (mstar_attn.ops) find this layer

    def _sinks(self, sinks) -> torch.Tensor | None:
        has, heads = self.spec.groups[self.group].sinks, self.spec.num_qo_heads
        if sinks is None:
            if has:
                raise PlanError(f"sinks: layer {self.layer}'s group {self.group} has attention sinks (LayerGroup.sinks): "
                                f"give the layer's sinks, a float32 tensor [{heads}]")
            return None
        if not has:
            raise PlanError(f"sinks: layer {self.layer}'s group {self.group} has no attention sinks (LayerGroup.sinks is "
                            "False): they would be ignored")
        got = kernels.misfit_sinks(sinks, heads, self.cache.k.device)
        if got is not None:
            raise PlanError(f"sinks: layer {self.layer}: expected float32 [{heads}] on {self.cache.k.device}, got {got}")
        return sinks.detach()  # (model weights: a kernel must not take its autograd path, which saves state for backward)

    @classmethod
    def for_model(cls, spec: AttentionSpec, device: torch.device | str | None = None, num_layers: int | None = None,
                  k_scale: float = 1.0, v_scale: float = 1.0, sinks=None) -> list[Attention]:
        """One Attention per layer (num_layers, default len(spec.layer_groups)), each over a zero-filled cache
        of its own on `device` (None: CUDA when torch sees a device, else the CPU), tagged with the layer's group. An FP8 spec's caches take the model's
        k_scale / v_scale (PagedKVCache). sinks: one entry per layer (a float32 tensor [num_qo_heads] where the
        layer's group has attention sinks, else None), or None for a spec without sinks."""
        n = len(spec.layer_groups) if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"num_layers: expected a positive number of layers, got {num_layers!r}")
        groups = [spec.group_of(layer) for layer in range(n)]  # (PlanError past layer_groups, before allocating)
        sinks = [None] * n if sinks is None else list(sinks)
        if len(sinks) != n:
            raise PlanError(f"sinks: expected one entry per layer ({n}), got {len(sinks)}")
        device = default_device(device)
        return [cls(spec, layer, PagedKVCache.allocate(spec, device, group=g, k_scale=k_scale, v_scale=v_scale), s)
                for (layer, g), s in zip(enumerate(groups), sinks)]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                step: DeviceStep | None = None) -> torch.Tensor:
        """Store k, v ([rows, kv_heads, head_dim]) in the layer's cache, then attend with q ([rows, qo_heads,
        head_dim]); returns [rows, qo_heads, head_dim]. Rows: the step's tokens (or a bucketed step's padded
        rows: DeviceStep.accepts_rows). step: a committed DeviceStep (the reference backend also takes an
        AttentionPlan); None: the step of the enclosing `step_context`, through the custom op
        torch.ops.mstar_attn.forward (what a compiled model calls). k, v may be None only on a cross-attention
        layer at a step that stores no encoder tokens for it: PlanError otherwise (the layer would attend over
        slots nothing wrote)."""
        if step is None:
            return self._through_op(q, k, v, False)
        if k is not None or v is not None:
            self.store(k, v, step)
        elif (step.plan if isinstance(step, DeviceStep) else step).stored_rows(self.group):
            cross = self.spec.groups[self.group].cross
            raise PlanError(f"forward: layer {self.layer} (group {self.group}) stores "
                            + ("this step's encoder K/V" if cross else "this step's new K/V") + ": give its k and v")
        return kernels.run(step, q, self.cache, self.group, k, v, sinks=self.sinks)

    def store(self, k: torch.Tensor, v: torch.Tensor, step: DeviceStep | None = None) -> None:
        """Store k, v in the layer's cache without attending: [rows, kv_heads, head_dim] (latent attention:
        c_kv [rows, 1, head_dim] and k_pe [rows, 1, mla_rope_dim]; a cross-attention layer: the encoder
        tokens the step stores for its group, plan.groups[group].stored rows). step None: the step_context's,
        through torch.ops.mstar_attn.store."""
        if step is None:
            torch.ops.mstar_attn.store.default(k, v, self.key)
            return
        if k is None or v is None:
            raise PlanError(f"store: layer {self.layer}: give both k and v")
        kernels.write_kv(step, k, v, self.cache, self.group)

    def attend(self, q: torch.Tensor, step: DeviceStep | None = None) -> torch.Tensor:
        """Attention over what the cache holds, nothing stored: for a layer whose K/V were stored apart
        (`store`; or the engine's own fused kernel into the same slots, step.slot_mapping, after which it
        calls `stored_by_engine(step)`, before a compiled forward for each layer). step None: the
        step_context's, through the custom op."""
        if step is None:
            return self._through_op(q, None, None, True)
        return kernels.run(step, q, self.cache, self.group, sinks=self.sinks)

    def out_shape(self, rows: int) -> tuple[int, int, int]:
        """What forward and attend return for `rows` query rows: (rows, num_qo_heads, head_dim)."""
        return rows, self.spec.num_qo_heads, self.spec.head_dim

    def _through_op(self, q, k, v, attend_only: bool) -> torch.Tensor:
        return torch.ops.mstar_attn.forward.default(q, k, v, self.key, attend_only)

    def __reduce__(self):
        """Copies and pickles are new layers over (a copy of) the cache, each with a key of its own."""
        return type(self), (self.spec, self.layer, self.cache) + (() if self.sinks is None else (self.sinks,))

    def stored_by_engine(self, step: DeviceStep) -> None:
        """Say that the engine stored this step's new K/V in this layer's cache itself (a fused RoPE + store
        into step.slot_mapping): `run` refuses, with a PlanError, a step nothing stored."""
        step.mark_stored(self.cache)
