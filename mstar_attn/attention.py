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
    spec.group_of(l). warm: build every kernel the spec's steps reach now (mstar_attn.warmup; the
    report is `warmup_report`). PlanError for what does not fit, before anything is allocated.
    """

    def __init__(self, spec: AttentionSpec, limits: PoolLimits, *, device: torch.device | str = "cuda",
                 num_layers: int | None = None, caches: Sequence[PagedKVCache] | None = None, warm: bool = False):
        if not isinstance(spec, AttentionSpec):
            raise PlanError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        n = len(spec.layer_groups) if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"num_layers: expected a positive number of layers, got {num_layers!r}")
        groups = [spec.group_of(layer) for layer in range(n)]  # (PlanError past layer_groups)
        if caches is not None:
            if len(caches) != n:
                raise PlanError(f"caches: {len(caches)} caches for {n} layers; give one per layer")
            for layer, (cache, g) in enumerate(zip(caches, groups)):
                if not isinstance(cache, PagedKVCache):
                    raise PlanError(f"caches[{layer}]: expected a PagedKVCache, got {type(cache).__name__}")
                cache.check(spec, f"caches[{layer}]", g)
        self.spec, self.num_layers, self.groups = spec, n, tuple(groups)
        self.pool = GraphBufferPool(spec, limits, device=device)
        self.caches = list(caches) if caches is not None else [
            PagedKVCache.allocate(spec, self.pool.device, group=g) for g in groups]  # (tagged: another group's call is refused)
        self.graphs: DecodeGraphs | None = None
        self.warmup_report: WarmupReport | None = warmup(spec, device=self.pool.device) if warm else None

    @property
    def table(self):
        """The pool's page table (PoolLimits.max_requests), or None."""
        return self.pool.table

    def step(self, batch: StepBatch | StepRows) -> DeviceStep:
        """build_plan(batch, spec) committed into the pool's next slot (a derived decode step's device work
        left for the decode graph, or the first forward, to run: GraphBufferPool.commit(defer=True)).
        The plan is step.plan (RoPE positions: step.plan.positions; each request's rows: qo_indptr)."""
        if not isinstance(batch, (StepBatch, StepRows)):
            raise PlanError(f"step: expected a StepBatch or StepRows, got {type(batch).__name__}")
        return self.pool.commit(build_plan(batch, self.spec), defer=True)

    def forward(self, step: DeviceStep, layer: int, q: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer` of the step: store k, v ([rows, kv_heads, head_dim], when given: a cross-attention
        layer stores its encoder's K/V only at the step that brings it) in the layer's cache, then attend
        with q ([rows, qo_heads, head_dim]); returns [rows, qo_heads, head_dim]. Rows: the step's tokens
        (or a bucketed step's padded rows, see DeviceStep.accepts_rows)."""
        cache = self._cache(layer)
        group = self.groups[layer]
        if (k is None) != (v is None):
            raise PlanError(f"forward: layer {layer}: give both k and v, or neither")
        if k is not None:
            kernels.write_kv(step, k, v, cache, group)
        return kernels.run(step, q, cache, group, k, v)

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

    def _cache(self, layer) -> PagedKVCache:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise PlanError(f"layer: expected a layer index 0..{self.num_layers - 1}, got {layer!r}")
        return self.caches[layer]
