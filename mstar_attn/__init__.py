"""mstar_attn: one explicit, CUDA-graph-capturable attention API over FlashInfer and FlashAttention.

Per engine step: `build_plan(batch, spec)` (pure, host) -> `pool.commit(plan)` (device buffers,
kernel scheduling) -> `write_kv` and `run` per layer, eagerly or by replaying captured graphs.
Layers, bottom up: metadata (pure) < cache < capture (state) < kernels (backends, found by name).
"""

from mstar_attn.cache import PagedKVCache
from mstar_attn.kernels import get_backend
from mstar_attn.metadata import (
    BACKENDS, AttentionPlan, AttentionSpec, CrossRows, GroupPages, GroupPlan, Kind, LayerGroup, Mode, PlanError, StaleStepError, StepBatch,
    build_plan,
)

__all__ = [
    "AttentionPlan", "AttentionSpec", "BACKENDS", "CrossRows", "GroupPages", "GroupPlan", "Kind", "LayerGroup", "Mode", "PagedKVCache",
    "PlanError", "StaleStepError", "StepBatch", "build_plan", "get_backend",
]
__version__ = "0.2.0"
