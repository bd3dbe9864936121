"""Code shared by the backends. Imports no GPU package (_sink_triton imports Triton on first CUDA use)."""

from __future__ import annotations

import math

import torch

from mstar_attn.kernels import _check, _sink_triton


def write_kv(step, k: torch.Tensor, v: torch.Tensor, cache, group: int | None = None) -> None:
    """Store a committed step's new K/V in the paged cache of one layer of layer group `group`, graph-safe.

    step: a live DeviceStep. k, v: [T or any row count step.accepts_rows allows, kv_heads,
    head_dim], spec.dtype, on the cache's device. Row t goes to flat slot
    step.groups[group].slot_mapping[t] (int64 device): a real token's slot, or for a padding row of
    a bucketed step a slot of the scratch page (no request's page is touched). group: the layer's
    group, required when the spec has own_pages groups (default 0: every group shares the slots).
    """
    plan = _check.step_plan(step, "write_kv")
    group = _check.layer_group(group, plan, "write_kv")
    _check.cache_fits(cache, plan, "write_kv", step=step, group=group)
    _check.new_kv(k, v, step, plan, cache, "write_kv", group)
    cache.store(step.groups[group].slot_mapping[: k.shape[0]], k, v)
    step.mark_stored(cache)


def with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, lse_base2: bool = False,
               fused: bool = False) -> torch.Tensor:
    """Attention output o [T, H, D] with its log-sum-exp lse [T, H] (each row's log of sum_j exp(logit_j);
    base 2 where lse_base2, as FlashInfer returns it) turned into the output with attention sinks [H]
    (float32): each head's sink logit s joins the denominator, so o * S / (S + exp(s)) = o * sigmoid(ln S - s).
    Computed in float32 (float64 for a float64 o or lse: the reference as an oracle), rounded once to o's
    dtype; None: o unchanged. fused: on CUDA, one fused Triton launch (_sink_triton) where it can run, for
    the GPU backends; the reference keeps the torch path (an oracle independent of the kernel it checks)."""
    if sinks is None:
        return o
    if fused and o.is_cuda and _sink_triton.available(o, lse, sinks):  # one fused launch (a graph node, not six)
        out = _sink_triton.apply(o, lse, sinks, math.log(2) if lse_base2 else 1.0)
        if out is not None:
            return out
    work = torch.float64 if torch.float64 in (o.dtype, lse.dtype) else torch.float32
    ln_sum = lse.to(work) * math.log(2) if lse_base2 else lse.to(work)
    return (o.to(work) * torch.sigmoid(ln_sum - sinks.to(work))[..., None]).to(o.dtype)
