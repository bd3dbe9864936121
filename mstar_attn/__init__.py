"""mstar_attn: one explicit, CUDA-graph-capturable attention API over FlashInfer and FlashAttention.

Per engine step: `build_plan(batch, spec)` (pure, host) -> `pool.commit(plan)` (device buffers,
kernel scheduling) -> `write_kv` and `run` per layer, eagerly or by replaying captured graphs.
Layers, bottom up: metadata (pure) < cache < capture (state) < kernels (backends, found by name).
"""

from mstar_attn.cache import PagedKVCache
from mstar_attn.capture import DeviceStep, GraphBufferPool, PoolLimits
from mstar_attn.capture.graphs import DecodeGraphs, RoundGraphs
from mstar_attn.kernels import get_backend, run, write_kv
from mstar_attn.metadata import (
    BACKENDS, AttentionPlan, AttentionSpec, CrossRows, GroupPages, GroupPlan, Kind, LayerGroup, Mode, PlanError, StaleStepError, StepBatch,
    build_plan,
)
from mstar_attn.metadata.batch import StepRows
from mstar_attn.metadata.draft import DraftRound, build_round
from mstar_attn.metadata.plan import build_tree_plan
from mstar_attn.metadata.tree import DraftTree, accepted_moves
from mstar_attn.attention import Attention  # noqa: E402  (above the layers it composes)
from mstar_attn.ops import step_context  # noqa: E402
from mstar_attn.piecewise import compile_piecewise  # noqa: E402

__all__ = [
    "Attention", "AttentionPlan", "AttentionSpec", "BACKENDS", "CrossRows", "DecodeGraphs", "DeviceStep", "DraftRound", "DraftTree",
    "GraphBufferPool",
    "GroupPages", "GroupPlan", "Kind", "LayerGroup", "Mode", "PagedKVCache", "PlanError", "PoolLimits", "RoundGraphs", "StaleStepError",
    "StepBatch", "StepRows", "build_plan", "build_round", "build_tree_plan", "get_backend", "run", "step_context", "write_kv",
    "accepted_moves", "compile_piecewise",
]
__version__ = "0.2.0"  # the one version: pyproject.toml reads it (tool.setuptools.dynamic)
