"""Host-side checks of what `run` and `write_kv` are given: metadata only (shapes, dtypes, devices,
the group index, whether the step is live), no device sync, so they hold in captured graphs too.
Each failure is a PlanError naming the argument and what the step expects."""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn.capture.step import DeviceStep
from mstar_attn.kernels import misfit_sinks
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan


def step_plan(step, where: str, plans_ok: bool = False) -> AttentionPlan:
    """The plan behind `step` (a live DeviceStep; with plans_ok, an AttentionPlan too)."""
    if isinstance(step, DeviceStep):
        step.check(where)
        return step.plan
    if plans_ok and isinstance(step, AttentionPlan):
        if step.rows is not None or any(gp.table_rows is not None for gp in step.groups):
            raise PlanError(f"{where}: a StepRows plan names no pages (nor do CrossRows: they are in the pool's tables); "
                            "commit it and pass the DeviceStep")
        if not step.sealed:
            raise PlanError(f"{where}: plan was not made by build_plan (an attrs.evolve'd or hand-made plan is not "
                            "checked again)")
        return step
    raise PlanError(f"{where}: step must be a DeviceStep from GraphBufferPool.commit"
                    + (" or an AttentionPlan" if plans_ok else "") + f", got {type(step).__name__}")


def stored_first(step, k, v, cache, group: int, where: str) -> None:
    """PlanError when run reads a committed step's new K/V from `cache` (one layer of `group`) before
    they are there: no write_kv stored them and the engine did not say it stores them itself
    (step.mark_stored(cache)). k or v given to such a backend would be ignored: that is an error too.
    Skipped while a CUDA graph is being captured (the capture's own write_kv marks the step; one
    stored outside the graph is the engine's contract). A cross group with nothing to store this
    step reads what earlier steps stored."""
    if not isinstance(step, DeviceStep) or step.stored_in(cache):
        return
    plan = step.plan
    new = plan.stored_rows(group)
    if k is not None or v is not None:
        raise PlanError(f"{where}: k and v are given, but no write_kv has stored this step's new K/V in this layer's cache; backend "
                        f"{plan.backend!r} reads them from the cache (only prefix-free backends such as "
                        "flashinfer_ragged take k and v): call write_kv(step, k, v, cache, group) before run")
    if new == 0 or (cache.k.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    raise PlanError(f"{where}: layer group {group}: this step's {new} new tokens were not stored in this layer's cache: "
                    "call write_kv(step, k, v, cache, group) before run, or, where the engine stores K/V itself "
                    "(a fused RoPE + store), call step.mark_stored(cache) after storing")


def sinks(s, plan: AttentionPlan, group: int, q: torch.Tensor, where: str) -> torch.Tensor | None:
    """The layer's attention sinks, checked against its group: a float32 tensor [num_qo_heads] on q's
    device where the group has sinks (LayerGroup.sinks), None where it has none (given ones would be
    ignored: an error too)."""
    heads, has = plan.spec.num_qo_heads, plan.spec.groups[group].sinks
    if s is None:
        if has:
            raise PlanError(f"{where}: layer group {group} has attention sinks (LayerGroup.sinks): pass the layer's "
                            f"sinks=, a float32 tensor [{heads}]")
        return None
    if not has:
        raise PlanError(f"{where}: sinks given, but layer group {group} has none (LayerGroup.sinks is False): "
                        "they would be ignored")
    device = q.device if isinstance(q, torch.Tensor) else None  # (a q that is no tensor: the query check names it)
    got = misfit_sinks(s, heads, device)
    if got is not None:
        raise PlanError(f"{where}: sinks must be float32 [{heads}] (one logit per query head) on {device or 'q.device'}, "
                        f"got {got}")
    return s


def group_index(group, plan: AttentionPlan, where: str) -> int:
    if type(group) is not int and (isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer))):
        raise PlanError(f"{where}: group must be a layer-group index (spec.group_of(layer)), got {group!r}")
    if not 0 <= group < len(plan.spec.groups):
        raise PlanError(f"{where}: group {group} is out of range: the spec has {len(plan.spec.groups)} layer groups")
    return int(group)


def layer_group(group, plan: AttentionPlan, where: str) -> int:
    """The layer group a write_kv / run call serves: `group`, which a spec with own_pages groups
    requires (their pages and slots differ from the shared list's); else default 0."""
    if group is None:
        own = plan.spec.own_page_groups
        if own:
            raise PlanError(f"{where}: layer group {own[0]} keeps its own page list (own_pages), so each layer reads "
                            "and writes its group's pages: pass group=spec.group_of(layer)")
        return 0
    return group_index(group, plan, where)


def cache_fits(cache, plan: AttentionPlan, where: str, finite: bool = False, step=None, group: int | None = None) -> None:
    """The cache fits the plan's spec (and serves `group`, when the cache is tagged with one); for a
    committed step, it is on the pool's device."""
    if not hasattr(cache, "k") or not hasattr(cache, "check"):
        raise PlanError(f"{where}: cache must be a PagedKVCache, got {type(cache).__name__}")
    cache.check(plan.spec, f"{where}: cache", group)
    if isinstance(step, DeviceStep) and cache.k.device != step.slots.device:
        raise PlanError(f"{where}: the cache is on {cache.k.device}, the step's pool on {step.slots.device}")
    if finite and not cache.finite:
        raise PlanError(f"{where}: backend {plan.backend!r} reads whole pages (rows past each sequence too), so the "
                        "cache must be known finite: make it with PagedKVCache.allocate or PagedKVCache.from_tensors")


def _tensor(t, name: str, heads: int, plan: AttentionPlan, device, where: str, dtypes, dim: int | None = None) -> torch.Tensor:
    dim = plan.spec.head_dim if dim is None else dim
    if not isinstance(t, torch.Tensor):
        raise PlanError(f"{where}: {name} must be a tensor [rows, {heads}, {dim}], got {type(t).__name__}")
    shape = t.shape
    if len(shape) != 3 or shape[1] != heads or shape[2] != dim:
        raise PlanError(f"{where}: {name} has shape {tuple(shape)}; expected [rows, {heads}, {dim}]")
    if t.dtype not in dtypes:
        raise PlanError(f"{where}: {name} is {t.dtype}; this step takes {' or '.join(map(str, dict.fromkeys(dtypes)))} "
                        "(spec.dtype)")
    if t.get_device() != device.index if device.type == "cuda" else t.device != device:
        raise PlanError(f"{where}: {name} is on {t.device}, the cache on {device}")
    return t


def row_count(t: torch.Tensor, name: str, step, plan: AttentionPlan, where: str) -> None:
    """PlanError unless t [n, ...] has the rows the step takes (see DeviceStep.accepts_rows)."""
    n = t.shape[0]
    ok = step.accepts_rows(n) if isinstance(step, DeviceStep) else n == plan.num_tokens
    if not ok:
        expected = step.rows_expected() if isinstance(step, DeviceStep) else str(plan.num_tokens)
        raise PlanError(f"{where}: {name} has {n} rows; this {plan.mode.value} step takes {expected}")


def query(q, step, plan: AttentionPlan, cache, where: str, dtypes=None) -> None:
    """q: [rows, qo_heads, head_dim] (latent attention: head_dim + mla_rope_dim, q_nope then q_pe)."""
    spec = plan.spec
    _tensor(q, "q", spec.num_qo_heads, plan, cache.k.device, where, dtypes or (spec.dtype,), spec.head_dim + spec.mla_rope_dim)
    row_count(q, "q", step, plan, where)


def new_kv(k, v, step, plan: AttentionPlan, cache, where: str, group: int = 0) -> None:
    """k, v: the step's new keys and values, cache dtype and device, rows as q's; for a
    cross-attention group, exactly the encoder tokens the step stores (sum of its new_lens)."""
    cross, spec = plan.spec.groups[group].cross, plan.spec
    for name, t in (("k", k), ("v", v)):  # (latent attention: k is c_kv, v is k_pe [rows, 1, mla_rope_dim])
        dim = spec.mla_rope_dim if name == "v" and spec.mla else spec.head_dim
        _tensor(t, name, spec.num_kv_heads, plan, cache.k.device, where, (spec.dtype,), dim)
        if not cross:
            row_count(t, name, step, plan, where)
        elif t.shape[0] != plan.group_plan(group).stored or t.shape[0] == 0:
            n = plan.group_plan(group).stored
            raise PlanError(f"{where}: {name} has {t.shape[0]} rows; layer group {group} is cross attention and this "
                            + (f"step stores {n} encoder tokens (the requests' whose GroupPages.new_lens is set)" if n else
                               "step stores no encoder K/V (new_lens is 0 for every request)"))
    if k.shape[0] != v.shape[0]:
        raise PlanError(f"{where}: k has {k.shape[0]} rows and v {v.shape[0]}")
