"""select_backend: which kernel backend serves a step, for specs with backend="auto".

Pure host code. The policy is a measured table (see `mstar_attn.tuning`); where the table says
nothing, FlashInfer paged serves the step.
"""

from __future__ import annotations

DEFAULT = "flashinfer"


def select_backend(spec, mode: str, batch_size: int, num_tokens: int, max_q_len: int, max_kv_len: int,
                   prefix_free: bool, table=None) -> str:
    """The backend name for one step. mode: a Mode value ("decode", "prefill", ...); prefix_free:
    every request's KV is new this step (ragged / varlen kernels may serve it)."""
    return DEFAULT
