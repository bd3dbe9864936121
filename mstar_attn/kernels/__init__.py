"""`run` / `write_kv`: dispatch a committed step (or, for the reference backend, a plan) to the
backend its plan names, found by name at run time (`metadata.backends.load`).

The registry itself (what each backend serves) is plain data in `mstar_attn.metadata.backends`;
this package holds the backend modules (reference.py; flashinfer.py with _flashinfer_fast.py, the one
module that reads FlashInfer internals, _cascade.py and _xqa.py; flashinfer_mla.py; flash_attn.py), their
protocol (base.py) and what they share (_check.py, _common.py, _tables.py). docs/architecture.md lists them.
"""

from __future__ import annotations

from types import ModuleType

import torch

from mstar_attn.metadata.backends import ALL_MODES, AUTO, BACKENDS, Capabilities, load
from mstar_attn.metadata.errors import PlanError

__all__ = ["ALL_MODES", "AUTO", "BACKENDS", "Capabilities", "get_backend", "misfit_sinks", "run", "write_kv"]


def misfit_sinks(s, heads: int, device) -> str | None:
    """Layer sinks as every backend takes them (Attention checks them too): None when s is a float32 tensor
    [heads] on `device` (None: any), else what it is, for the PlanError."""
    if isinstance(s, torch.Tensor) and s.dtype == torch.float32 and tuple(s.shape) == (heads,) \
            and (device is None or s.device == device):
        return None
    return f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__


def get_backend(name: str) -> ModuleType:
    """The backend module for `name`, imported on first use (GPU packages load only here)."""
    return load(name)


def _backend_of(step, where: str) -> ModuleType:
    name = getattr(getattr(step, "plan", step), "backend", None)  # a DeviceStep, or a plan (reference backend)
    if not isinstance(name, str):
        raise PlanError(f"{where}: step must be a DeviceStep (GraphBufferPool.commit) or an AttentionPlan, "
                        f"got {type(step).__name__}")
    return load(name)


def write_kv(step, k: torch.Tensor, v: torch.Tensor, cache, group: int | None = None) -> None:
    """Store the step's new K/V ([T or step.padded_num_tokens, kv_heads, head_dim]) for one layer of layer
    group `group` through the backend that step.plan names. group: required when the spec has
    own_pages groups (each writes its own pages), else optional."""
    _backend_of(step, "write_kv").write_kv(step, k, v, cache, group)


def run(step, q: torch.Tensor, cache, group: int | None = None, k: torch.Tensor | None = None,
        v: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one layer of layer group `group` (required when the spec has own_pages
    groups, else default 0) through the backend that step.plan names (see each backend's run).
    sinks: the layer's attention sinks, float32 [num_qo_heads], where its group has them (LayerGroup.sinks)."""
    backend = _backend_of(step, "run")
    if sinks is None:  # (a backend written before sinks takes no such argument: it serves no sink group)
        return backend.run(step, q, cache, group, k, v)
    return backend.run(step, q, cache, group, k, v, sinks=sinks)
