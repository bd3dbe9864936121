"""Backend registry: what each backend can serve (plain data, no GPU import), a lazy loader,
and `run` / `write_kv` that dispatch a committed step to the backend its plan names.

Every backend module exposes:
    write_kv(step, k, v, cache)                 store the step's new K/V in the paged cache
    run(step, q, cache, group=0, k=None, v=None) attention for one layer of layer group `group`
    Scheduler(pool)  (GPU backends)              host-side scheduling, called by pool.commit
Several registry names may share one module (FlashInfer paged and ragged): the module reads
`step.plan.backend` to pick the kernel.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import attrs
import torch

from mstar_attn.metadata.spec import AttentionSpec, PlanError

_HALF = frozenset({torch.float16, torch.bfloat16})
ALL_MODES = frozenset({"decode", "prefill", "verify", "mixed", "extend"})


@attrs.frozen
class Capabilities:
    """module: the backend's module path. modes: Mode values it serves. prefix_free: it attends
    over the step's new K/V only (ragged / varlen), so every request's KV must be new this step.
    package: what it imports (flash_attn.cute, not flash_attn: FlashAttention-2 has no cute)."""

    module: str
    dtypes: frozenset
    head_dims: frozenset | None = None  # None: any
    modes: frozenset = ALL_MODES
    prefix_free: bool = False
    package: str | None = None  # the third-party module it imports (None: torch only)

    def check(self, spec: AttentionSpec, name: str) -> None:
        if spec.dtype not in self.dtypes:
            raise PlanError(f"spec.dtype: backend {name!r} serves {sorted(map(str, self.dtypes))}, not {spec.dtype}")
        if self.head_dims is not None and spec.head_dim not in self.head_dims:
            raise PlanError(f"spec.head_dim: backend {name!r} serves head dims {sorted(self.head_dims)}, not {spec.head_dim}")


_FA = "mstar_attn.kernels.flash_attn"
_FI = "mstar_attn.kernels.flashinfer"
BACKENDS: dict[str, Capabilities] = {
    "reference": Capabilities("mstar_attn.kernels.reference", _HALF | {torch.float32, torch.float64}),
    "flashinfer": Capabilities(_FI, _HALF, frozenset({64, 128, 256}), package="flashinfer"),
    "flashinfer_ragged": Capabilities(_FI, _HALF, frozenset({64, 128, 256}), frozenset({"prefill"}), True, "flashinfer"),
    "flash_attn": Capabilities(_FA, _HALF, frozenset({64, 96, 128}), package="flash_attn.cute"),
    "flash_attn_varlen": Capabilities(_FA, _HALF, frozenset({64, 96, 128}), frozenset({"prefill"}), True, "flash_attn.cute"),
}
AUTO = "auto"  # spec.backend: build_plan picks per step with metadata.select.select_backend


def get_backend(name: str) -> ModuleType:
    """The backend module for `name`, imported on first use (GPU packages load only here)."""
    if name not in BACKENDS:
        raise PlanError(f"unknown backend {name!r} (known: {sorted(BACKENDS)})")
    return importlib.import_module(BACKENDS[name].module)


def _backend_of(step) -> str:
    return getattr(step, "plan", step).backend  # a DeviceStep, or a plan (reference backend)


def write_kv(step, k: torch.Tensor, v: torch.Tensor, cache) -> None:
    """Store the step's new K/V ([T, kv_heads, head_dim]) through the backend that step.plan names."""
    get_backend(_backend_of(step)).write_kv(step, k, v, cache)


def run(step, q: torch.Tensor, cache, group: int = 0, k: torch.Tensor | None = None,
        v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one layer through the backend that step.plan names (see each backend's run)."""
    return get_backend(_backend_of(step)).run(step, q, cache, group, k, v)
