"""The GPU paged backends' shared scenarios, as data: for FlashInfer and FlashAttention-4, the kernel
combos (each compiles its own kernels), the mode cases over them, the smoke picks and the pool
settings of the long walks. `tests/kernels/test_paged_backends.py` runs every scenario on every
backend the machine has; the backend files keep what only one backend has."""

from __future__ import annotations

import importlib

import attrs
import pytest
import torch

from mstar_attn import LayerGroup
from tests.helpers import GPU_GROUPS, make_step
from tests.support.paged_scenarios import MODES


@attrs.frozen
class PagedBackend:
    """name: the backend (AttentionSpec.backend); module: its kernels module; combos: name -> make_step
    keyword arguments (dtype, page size, heads, head dim, soft-cap, groups); mode_cases: (combo, q_lens,
    kv_lens, mode) checked against the reference; smoke: the scenarios whose first case is in the smoke
    tier ("modes", "replay", "table", "cross"); walk: GraphBufferPool arguments of the 200-step walk."""

    name: str
    module: str
    combos: dict
    mode_cases: tuple
    smoke: frozenset
    walk: dict = attrs.field(factory=dict)
    needs: str = ""  # the import that must work (besides CUDA)

    def load(self):
        """The kernels module, or a skip naming what is missing."""
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        try:
            importlib.import_module(self.needs)
        except ImportError as e:
            pytest.skip(f"{self.name} needs {self.needs}: {e}")
        return importlib.import_module(self.module)

    def gpu_step(self, seed, q_lens, kv_lens, **combo):
        """make_step's tuple on CUDA for this backend, the step's new K/V not yet written; combo: a combo's
        keyword arguments over STEP_DEFAULTS."""
        c = {**STEP_DEFAULTS, **combo}
        return make_step(seed, q_lens, kv_lens, c.pop("page_size"), c.pop("dtype"), device="cuda", backend=self.name,
                         write=False, **c)


STEP_DEFAULTS = dict(page_size=16, dtype=torch.bfloat16, heads=(32, 8), head_dim=128, soft_cap=0.0, groups=GPU_GROUPS)


def _all_modes(combos: dict, keep=lambda combo, mode: True) -> tuple:
    return tuple((c, *m) for c in combos for m in MODES if keep(c, m[2]))


# FlashInfer: dtype, head dim, soft-cap and window are template parameters of its modules (page size is not).
_FI_COMBOS = {
    "bf16-gqa4-p16-d128": dict(page_size=16, dtype=torch.bfloat16, heads=(32, 8), head_dim=128, groups=GPU_GROUPS),
    "fp16-mha-p64-d64-cudacores": dict(page_size=64, dtype=torch.float16, heads=(8, 8), head_dim=64,
                                       groups=(LayerGroup(), LayerGroup("noncausal"))),
    "bf16-gqa4-p1-d256-cap-tensorcores": dict(page_size=1, dtype=torch.bfloat16, heads=(16, 4), head_dim=256,
                                              soft_cap=30.0, groups=(LayerGroup(),)),
}
# FA4: pages 1, 16 and 64 take its cp.async page loader, page 128 its TMA loader.
_FA_COMBOS = {
    "bf16-gqa4-p16-d128": dict(page_size=16, dtype=torch.bfloat16, heads=(32, 8)),
    "fp16-mha-p64-cap": dict(page_size=64, dtype=torch.float16, heads=(8, 8), soft_cap=20.0),
    "bf16-gqa8-p128-tma": dict(page_size=128, dtype=torch.bfloat16, heads=(16, 2), groups=GPU_GROUPS[:1]),
    "bf16-gqa4-p1-d64-cap": dict(page_size=1, dtype=torch.bfloat16, heads=(16, 4), head_dim=64, soft_cap=30.0,
                                 groups=GPU_GROUPS[:2]),
}

BACKENDS = {
    "flashinfer": PagedBackend(
        "flashinfer", "mstar_attn.kernels.flashinfer", _FI_COMBOS, _all_modes(_FI_COMBOS),
        frozenset({"modes", "replay", "table", "cross"}), needs="flashinfer"),
    "flash_attn": PagedBackend(
        "flash_attn", "mstar_attn.kernels.flash_attn", _FA_COMBOS,
        _all_modes(_FA_COMBOS, lambda c, mode: c != "bf16-gqa8-p128-tma" or mode in ("decode", "verify")),
        frozenset({"modes"}), walk=dict(max_pages_per_request=128), needs="flash_attn.cute"),
}


def params(scenario: str, cases_of) -> list:
    """pytest params (backend name, *case) over every backend, cases_of(backend) -> its cases. Where
    `scenario` is one of the backend's smoke picks, its first case is in the smoke tier ("modes": every
    mode case of its first combo)."""
    out = []
    for name, b in BACKENDS.items():
        cases = [c if isinstance(c, tuple) else (c,) for c in cases_of(b)]
        for i, case in enumerate(cases):
            first = case[0] == cases[0][0] if scenario == "modes" else i == 0
            marks = [pytest.mark.smoke] if scenario in b.smoke and first else []
            out.append(pytest.param(name, *case, marks=marks))
    return out
