"""`Attention`: one object per model for an engine: its spec, pool, per-layer caches and decode graphs.

An engine step is then

    step = attn.step(batch)                    # build_plan + commit: StepBatch or StepRows
    for layer in range(num_layers):            # inside the model's forward
        out = attn.forward(step, layer, q, k, v)   # stores k, v in the layer's cache, then attends

and a decode forward captured once (`attn.capture(fn, inputs)`) replays per step (`attn.replay(step,
**inputs)`). Everything here is the layers below, composed: `build_plan`, `GraphBufferPool.commit(...,
defer=True)` (a derived decode step's device work runs inside the decode graph), `write_kv` / `run`,
`DecodeGraphs`, `warmup`. The pool (`attn.pool`) is the one place state lives; the object only holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from mstar_attn import kernels
from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.limits import PoolLimits
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata.batch import StepBatch, StepRows
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import build_plan
from mstar_attn.metadata.spec import AttentionSpec
from mstar_attn.warmup import WarmupReport, warmup


class Attention:
    """A model's attention: spec, a GraphBufferPool bounded by `limits`, one PagedKVCache per layer
    (allocated zero-filled on `device`, or `caches`, one per layer, each fitting the spec), and the
    decode graphs once captured.

    num_layers: the model's layers (default: len(spec.layer_groups)); layer l uses layer group
    spec.group_of(l). warm: build every kernel the spec's steps reach first (mstar_attn.warmup, on a
    pool and cache of its own; the report is `warmup_report`). An FP8 spec takes `caches` (their
    k_scale / v_scale are the model's calibration). PlanError for what does not fit, before the pool
    and caches are allocated.
    """

    def __init__(self, spec: AttentionSpec, limits: PoolLimits, *, device: torch.device | str = "cuda",
                 num_layers: int | None = None, caches: Sequence[PagedKVCache] | None = None, warm: bool = False):
        if not isinstance(spec, AttentionSpec):
            raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        n = len(spec.layer_groups) if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"num_layers: expected a positive number of layers, got {num_layers!r}")
        groups = [spec.group_of(layer) for layer in range(n)]  # (PlanError past layer_groups)
        if caches is None and spec.fp8_kv:
            raise PlanError("caches: an FP8 spec's caches carry the model's k_scale / v_scale: pass caches=[PagedKVCache."
                            "allocate(spec, device, group=spec.group_of(layer), k_scale=..., v_scale=...) per layer]")
        if caches is not None:
            self._check_caches(spec, caches, groups, torch.device(device))
        self.spec, self.num_layers, self.groups = spec, n, tuple(groups)
        self.warmup_report: WarmupReport | None = warmup(spec, device=device) if warm else None
        self.pool = GraphBufferPool(spec, limits, device=device)
        self.caches = list(caches) if caches is not None else [
            PagedKVCache.allocate(spec, self.pool.device, group=g) for g in groups]  # (tagged: another group's call is refused)
        self.graphs: DecodeGraphs | None = None

    @staticmethod
    def _check_caches(spec: AttentionSpec, caches: Sequence[PagedKVCache], groups: list[int], device: torch.device) -> None:
        if len(caches) != len(groups):
            raise PlanError(f"caches: {len(caches)} caches for {len(groups)} layers; give one per layer")
        seen: dict[int, int] = {}
        for layer, (cache, g) in enumerate(zip(caches, groups)):
            if not isinstance(cache, PagedKVCache):
                raise PlanError(f"caches[{layer}]: expected a PagedKVCache, got {type(cache).__name__}")
            cache.check(spec, f"caches[{layer}]", g)
            if cache.k.device.type != device.type or (device.index is not None and cache.k.device != device):
                raise PlanError(f"caches[{layer}]: on {cache.k.device}, the pool on {device}")
            other = seen.setdefault(cache.k.data_ptr(), layer)
            if other != layer:
                raise PlanError(f"caches[{layer}]: the same cache as caches[{other}]; each layer stores its own K/V")

    @property
    def table(self):
        """The pool's page table (PoolLimits.max_requests), or None."""
        return self.pool.table

    def step(self, batch: StepBatch | StepRows, defer: bool = True) -> DeviceStep:
        """build_plan(batch, spec) committed into the pool's next slot. The plan is step.plan (RoPE
        positions: step.plan.positions; each request's rows: step.plan.qo_indptr). defer: a derived
        decode step's device work is left for `replay` (inside the decode graph) or the first `forward`
        (GraphBufferPool.commit(defer=True)); a CUDA graph of the engine's own that reads the step
        without calling forward needs step.prepare() first (or defer=False)."""
        if not isinstance(batch, (StepBatch, StepRows)):
            raise PlanError(f"step: expected a StepBatch or StepRows, got {type(batch).__name__}")
        return self.pool.commit(build_plan(batch, self.spec), defer=defer)

    def forward(self, step: DeviceStep, layer: int, q: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer` of the step: store k, v in the layer's cache (`store`), then attend with q ([rows,
        qo_heads, head_dim]; latent attention: [rows, heads, head_dim + mla_rope_dim]); returns [rows,
        qo_heads, head_dim]. Rows: the step's tokens (or a bucketed step's padded rows, see
        DeviceStep.accepts_rows). k, v may be left out only on a cross-attention layer at a step that
        stores no encoder tokens for it (PlanError otherwise: the layer would attend over stale slots)."""
        group = self._group(layer)
        cache = self.caches[layer]
        if k is not None or v is not None:
            self.store(step, layer, k, v)
        elif not self.spec.groups[group].cross or step.plan.groups[group].stored:
            raise PlanError(f"forward: layer {layer} (group {group}) stores "
                            + ("this step's encoder K/V" if self.spec.groups[group].cross else "this step's new K/V")
                            + ": give its k and v")
        return kernels.run(step, q, cache, group, k, v)

    def store(self, step: DeviceStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v in layer `layer`'s cache without attending: [rows, kv_heads, head_dim] (latent attention:
        c_kv [rows, 1, head_dim] and k_pe [rows, 1, mla_rope_dim]; a cross-attention layer: the encoder
        tokens this step stores, plan.groups[group].stored rows)."""
        group = self._group(layer)
        if k is None or v is None:
            raise PlanError(f"store: layer {layer}: give both k and v")
        kernels.write_kv(step, k, v, self.caches[layer], group)

    def capture(self, fn: Callable[[DeviceStep, dict], torch.Tensor], inputs: dict[str, torch.Tensor],
                **options) -> None:
        """Capture fn(step, inputs) (the model's decode forward calling `forward`) as CUDA graphs per pool
        slot and bucket: DecodeGraphs(pool, fn, inputs).capture(**options). Before serving."""
        self.graphs = DecodeGraphs(self.pool, fn, inputs)
        self.graphs.capture(**options)

    def replay(self, step: DeviceStep, **inputs: torch.Tensor) -> torch.Tensor:
        """fn(step, inputs): replayed when a captured graph serves the step, else run eagerly."""
        if self.graphs is None:
            raise PlanError("replay: nothing is captured yet; call capture(fn, inputs) first")
        return self.graphs(step, **inputs)

    def _group(self, layer) -> int:
        """Layer's group index, or PlanError for a layer index out of range."""
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise PlanError(f"layer: expected a layer index 0..{self.num_layers - 1}, got {layer!r}")
        return self.groups[layer]
