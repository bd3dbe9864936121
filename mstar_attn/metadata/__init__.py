"""Host-side step description and the pure planner."""

from mstar_attn.metadata.batch import StepBatch
from mstar_attn.metadata.spec import AttentionSpec, Kind, LayerGroup, PlanError
from mstar_attn.metadata.plan import AttentionPlan, GroupPlan, Mode, build_plan

__all__ = ["AttentionPlan", "AttentionSpec", "GroupPlan", "Kind", "LayerGroup", "Mode", "PlanError", "StepBatch", "build_plan"]
