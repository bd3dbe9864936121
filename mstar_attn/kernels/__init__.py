"""Backend registry: what each backend can serve (plain data, no GPU import) and a lazy loader.

Every backend module exposes the same two functions:
    write_kv(plan, k, v, cache, slots=None)  store the step's new K/V in the paged cache
    run(plan, q, cache, group=0, ...) -> out attention for one layer of layer group `group`
"""

from __future__ import annotations

import importlib
from types import ModuleType

import attrs
import torch

from mstar_attn.metadata.spec import AttentionSpec, PlanError

_HALF = frozenset({torch.float16, torch.bfloat16})


@attrs.frozen
class Capabilities:
    module: str
    dtypes: frozenset
    head_dims: frozenset | None = None  # None: any
    max_page_size: int | None = None

    def check(self, spec: AttentionSpec) -> None:
        name = self.module.rsplit(".", 1)[-1]
        if spec.dtype not in self.dtypes:
            raise PlanError(f"spec.dtype: backend {name!r} serves {sorted(map(str, self.dtypes))}, not {spec.dtype}")
        if self.head_dims is not None and spec.head_dim not in self.head_dims:
            raise PlanError(f"spec.head_dim: backend {name!r} serves head dims {sorted(self.head_dims)}, not {spec.head_dim}")


BACKENDS: dict[str, Capabilities] = {
    "reference": Capabilities("mstar_attn.kernels.reference", _HALF | {torch.float32, torch.float64}),
    "flashinfer": Capabilities("mstar_attn.kernels.flashinfer", _HALF, frozenset({64, 128, 256})),
}


def get_backend(name: str) -> ModuleType:
    """The backend module for `name`, imported on first use (GPU packages load only here)."""
    if name not in BACKENDS:
        raise PlanError(f"unknown backend {name!r} (known: {sorted(BACKENDS)})")
    return importlib.import_module(BACKENDS[name].module)
