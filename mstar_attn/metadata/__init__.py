"""The bottom layer: the step description, the spec, the backend registry and the pure planner.

Imports numpy, attrs and torch (for dtypes) only; nothing of the package above it.
"""

from mstar_attn.metadata.backends import AUTO, BACKENDS, Capabilities
from mstar_attn.metadata.batch import CrossRows, GroupPages, StepBatch, StepRows
from mstar_attn.metadata.errors import PlanError, StaleStepError
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, AttentionPlan, GroupPlan, Mode, build_plan, scratch_plan
from mstar_attn.metadata.spec import AttentionSpec, Kind, LayerGroup

__all__ = [
    "AUTO", "BACKENDS", "MAX_VERIFY_Q_LEN", "AttentionPlan", "AttentionSpec", "Capabilities", "CrossRows", "GroupPages", "GroupPlan", "Kind",
    "LayerGroup", "Mode", "PlanError", "StaleStepError", "StepBatch", "build_plan", "scratch_plan",
]
