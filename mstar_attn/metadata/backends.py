"""The backend registry: what each backend serves, as plain data (no GPU import, nothing above).

`BACKENDS[name]` says which module implements a backend, which dtypes, head dims and step modes it
serves and which third-party package it needs. The pool and `kernels.run` find a backend's module
by name at run time (`load`), so nothing below `kernels/` imports a backend at import time.

Every backend module exposes write_kv, run and (backends with per-pool state) a PoolState: the
protocol is written down in kernels/base.py.
Several names may share one module (FlashInfer paged and ragged): the module reads
`step.plan.backend` to pick the kernel.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

import attrs
import torch

from mstar_attn.metadata.errors import PlanError

HALF = frozenset({torch.float16, torch.bfloat16})
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})  # KV cache dtypes beside the query's (AttentionSpec.kv_dtype)
ALL_MODES = frozenset({"decode", "prefill", "verify", "mixed", "extend"})
AUTO = "auto"  # spec.backend: build_plan picks per step (metadata.select.select_backend)


@attrs.frozen
class Capabilities:
    """module: the backend's module path. modes: Mode values it serves. prefix_free: it attends
    over the step's new K/V only (ragged / varlen), so every request's KV must be new this step.
    package: what it imports (flash_attn.cute, not flash_attn: FlashAttention-2 has no cute).
    host_plans: it reads host plan arrays and needs no pool (the reference backend)."""

    module: str
    dtypes: frozenset
    head_dims: frozenset | None = None  # None: any
    modes: frozenset = ALL_MODES
    prefix_free: bool = False
    package: str | None = None  # the third-party module it imports (None: torch only)
    needs_finite_cache: bool = False  # its kernel reads whole pages, rows past each sequence included
    kv_dtypes: frozenset = frozenset()  # KV cache dtypes it serves beside the query dtype (FP8)
    kv_note: str = ""  # why it serves no other KV dtype, for the PlanError
    mla: bool = False  # it serves latent attention (AttentionSpec.mla_rope_dim > 0)
    mla_only: bool = False  # it serves latent attention and nothing else
    cascade: bool = False  # it runs shared-prefix (cascade) steps (AttentionSpec.cascade)
    fp8_math: bool = False  # it runs FP8 decode math (AttentionSpec.fp8_math: FlashInfer's XQA)
    sinks: bool = False  # it serves attention sinks (LayerGroup.sinks: run(..., sinks=))
    tree: bool = False  # it serves verify steps of draft token trees (build_tree_plan)

    def serves_kv(self, spec) -> bool:
        """Whether it serves spec's KV cache dtype (the query dtype, or one of kv_dtypes)."""
        return spec.kv_cache_dtype == spec.dtype or spec.kv_cache_dtype in self.kv_dtypes

    def check(self, spec, name: str) -> None:
        """PlanError unless this backend serves spec's dtype, KV cache dtype and head_dim."""
        if spec.dtype not in self.dtypes:
            raise PlanError(f"spec.dtype: backend {name!r} serves {sorted(map(str, self.dtypes))}, not {spec.dtype}")
        if spec.mla and not self.mla:
            raise PlanError(f"spec.mla_rope_dim: backend {name!r} does not serve latent attention (MLA); "
                            "'flashinfer_mla' and 'reference' do")
        if self.mla_only and not spec.mla:
            raise PlanError(f"spec.mla_rope_dim: backend {name!r} serves latent attention (MLA) only; set mla_rope_dim")
        if not self.serves_kv(spec):
            raise PlanError(f"spec.kv_dtype: backend {name!r} keeps K/V in the query dtype, not {spec.kv_cache_dtype}"
                            + (f" ({self.kv_note})" if self.kv_note else ""))
        if spec.has_sinks and not self.sinks:
            g = next(i for i, group in enumerate(spec.groups) if group.sinks)
            asked = f"{name!r}" if spec.backend == name else f"{spec.backend!r} (falling back to {name!r})"
            raise PlanError(f"spec.groups[{g}].sinks: the group has attention sinks and backend {asked} does not serve "
                            f"them (backends that do: {', '.join(repr(n) for n in SINK_BACKENDS)})")
        if self.head_dims is not None and spec.head_dim not in self.head_dims:
            raise PlanError(f"spec.head_dim: backend {name!r} serves head dims {sorted(self.head_dims)}, not {spec.head_dim}")


_FA = "mstar_attn.kernels.flash_attn"
_FI = "mstar_attn.kernels.flashinfer"
_FI_DIMS = frozenset({64, 128, 256})
_FA_DIMS = frozenset({64, 96, 128})
_FA_FP8 = "FlashAttention-4 4.0.0b36 reads FP8 K/V on SM100 only, and this package targets Hopper"
BACKENDS: dict[str, Capabilities] = {
    "reference": Capabilities("mstar_attn.kernels.reference", HALF | {torch.float32, torch.float64}, kv_dtypes=FP8,
                              mla=True, cascade=True, fp8_math=True, sinks=True, tree=True),
    "flashinfer": Capabilities(_FI, HALF, _FI_DIMS, package="flashinfer", kv_dtypes=FP8, cascade=True, fp8_math=True,
                               sinks=True, tree=True),
    "flashinfer_ragged": Capabilities(_FI, HALF, _FI_DIMS, frozenset({"prefill"}), True, "flashinfer",
                                      kv_note="it attends over the step's K/V as given, not as an FP8 cache holds them"),
    "flashinfer_mla": Capabilities("mstar_attn.kernels.flashinfer_mla", frozenset({torch.bfloat16}), frozenset({128, 256, 512}),
                                   package="flashinfer", mla=True, mla_only=True,
                                   kv_note="FP8 latent caches are not served yet"),
    "flash_attn": Capabilities(_FA, HALF, _FA_DIMS, package="flash_attn.cute", needs_finite_cache=True, kv_note=_FA_FP8,
                               sinks=True),
    "flash_attn_varlen": Capabilities(_FA, HALF, _FA_DIMS, frozenset({"prefill"}), True, "flash_attn.cute",
                                      kv_note=_FA_FP8),
}

# what backend="auto" serves with where the dispatch table says nothing, latent attention, and cascade steps
AUTO_DEFAULT, AUTO_MLA, AUTO_CASCADE = "flashinfer", "flashinfer_mla", "flashinfer"
_GPU_FIRST = sorted(BACKENDS, key=lambda n: BACKENDS[n].package is None)
CASCADE_BACKENDS = tuple(n for n in _GPU_FIRST if BACKENDS[n].cascade)  # the backends that run cascade steps
FP8_MATH_BACKENDS = tuple(n for n in _GPU_FIRST if BACKENDS[n].fp8_math)
SINK_BACKENDS = tuple(n for n in _GPU_FIRST if BACKENDS[n].sinks)  # the backends that serve attention sinks
TREE_BACKENDS = tuple(n for n in _GPU_FIRST if BACKENDS[n].tree)  # the backends that verify token trees


def capabilities(name: str) -> Capabilities:
    """BACKENDS[name], or PlanError naming the known backends."""
    caps = BACKENDS.get(name)
    if caps is None:
        raise PlanError(f"backend: unknown backend {name!r} (known: {sorted(BACKENDS)})")
    return caps


def load(name: str) -> ModuleType:
    """The module implementing backend `name`, imported on first use (GPU packages load only here).
    Later calls cost one dict lookup in sys.modules."""
    caps = capabilities(name)
    module = sys.modules.get(caps.module)
    if module is not None:
        return module
    try:
        return importlib.import_module(caps.module)
    except ImportError as e:
        if caps.package is None:
            raise
        raise ImportError(f"backend {name!r} needs the {caps.package.split('.')[0]} package ({e}); install the GPU "
                          "extras (pip install 'mstar_attn[gpu]', or -e '.[gpu]' in a checkout), or choose "
                          "backend='reference' (any device)") from e


def pool_state_class(name: str) -> type | None:
    """The class of backend `name`'s per-pool state (its module's PoolState; None: a host-only backend).
    A module written before the rename that has only `Scheduler` still works, with a DeprecationWarning."""
    module = load(name)
    cls = getattr(module, "PoolState", None)
    if cls is None and hasattr(module, "Scheduler"):
        warnings.warn(f"{module.__name__}.Scheduler: name a backend's per-pool state PoolState (kernels/base.py)",
                      DeprecationWarning, stacklevel=3)
        cls = module.Scheduler
    return cls
