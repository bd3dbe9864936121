"""Pure-torch attention over the paged cache: runs anywhere (CPU included) and is the test oracle.

It loops over requests in Python: correct and obvious, not fast. It takes an AttentionPlan or a
committed DeviceStep and reads the plan's host arrays; a StepRows plan names no pages, so for its
committed step the page lists and slots are read back from the step's device arrays (a sync).
"""

from __future__ import annotations

import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.kernels import _check
from mstar_attn.kernels._common import with_sinks
from mstar_attn.metadata.plan import AttentionPlan
from mstar_attn.metadata.spec import Kind

_ORACLE_DTYPES = (torch.float32, torch.float64)


def write_kv(step, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, group: int | None = None) -> None:
    """Store the step's new keys and values for one layer of layer group `group` (required when the
    spec has own_pages groups, else default 0). k, v: [T (or a committed step's padded rows),
    kv_heads, head_dim], spec.dtype, on the cache's device (latent attention: k is c_kv [.., 1,
    head_dim], v is k_pe [.., 1, mla_rope_dim]); token t goes to slot plan.slots_of(group)[t]. An
    FP8 cache stores them quantized (PagedKVCache.store: scaled, saturated)."""
    plan = _check.step_plan(step, "write_kv", plans_ok=True)
    group = _check.layer_group(group, plan, "write_kv")
    _check.cache_fits(cache, plan, "write_kv", step=step, group=group)
    _check.new_kv(k, v, step, plan, cache, "write_kv", group)
    gp, T = plan.groups[group], plan.stored_rows(group)
    if plan.rows is not None or gp.table_rows is not None:  # StepRows / CrossRows: the pool derived the slots
        slots = step.groups[group].slot_mapping[:T]
    else:
        slots = torch.tensor(plan.slots_of(group), device=k.device)
    cache.store(slots.long(), k[:T], v[:T])
    if step is not plan:  # (a committed step: run's misuse check reads it)
        step.mark_stored(cache)


def run(step, q: torch.Tensor, cache: PagedKVCache, group: int | None = None, k=None, v=None,
        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's queries over the cache for one layer of layer group `group`
    (required when the spec has own_pages groups, else default 0).

    q: [T (or a committed step's padded rows), num_qo_heads, head_dim (+ mla_rope_dim: latent
    attention)] on the cache's device, in spec.dtype or, as an oracle, float32 / float64. Returns
    [rows, num_qo_heads, head_dim] in q's dtype, computed in
    float32 (float64 for float64 q); padding rows past T are zero. Queries sit at the end of each
    sequence. k, v: unused, the new K/V are read from the cache (write_kv first). sinks: float32
    [num_qo_heads] on q's device where the group has attention sinks (LayerGroup.sinks), else None:
    each head's sink logit joins its softmax denominator (_common.with_sinks).
    """
    plan = _check.step_plan(step, "run", plans_ok=True)
    group = _check.layer_group(group, plan, "run")
    _check.cache_fits(cache, plan, "run", step=step, group=group)
    _check.query(q, step, plan, cache, "run", (plan.spec.dtype, *_ORACLE_DTYPES))
    _check.stored_first(step, k, v, cache, group, "run")
    sinks = _check.sinks(sinks, plan, group, q, "run")
    gp = plan.groups[group]
    if plan.cascade is not None and group in plan.spec.cascade_groups:
        return _attend_cascade(plan, q, cache, group, sinks)
    indices = gp.kv_indices if gp.kv_indices is not None else step.groups[group].kv_indices[: gp.kv_indptr[-1]].cpu().numpy()
    return _attend(plan, q, cache, group, indices, sinks)


def _attend(plan: AttentionPlan, q: torch.Tensor, cache: PagedKVCache, group: int, kv_indices,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    spec, gp = plan.spec, plan.groups[group]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = spec.num_qo_heads // spec.num_kv_heads
    out = q.new_zeros(q.shape[0], q.shape[1], spec.head_dim)  # (latent attention: q is wider than the output)
    for i in range(plan.batch_size):
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        p0, p1 = int(gp.kv_indptr[i]), int(gp.kv_indptr[i + 1])
        n_kv, start = int(gp.kv_lens[i]), 0 if gp.kv_start is None else int(gp.kv_start[i])
        pages = torch.tensor(kv_indices[p0:p1], device=q.device, dtype=torch.long)
        k, v = (x[:n_kv].repeat_interleave(rep, dim=1) for x in cache.read(pages, work))  # (FP8: dequantized)
        if spec.mla:  # keys [c_kv, k_pe] against [q_nope, q_pe]; values c_kv
            k, v = torch.cat([k, v], dim=-1), k
        hidden = (_hidden(gp.group, int(plan.kv_lens[i]), q1 - q0, start, start + n_kv, q.device) if plan.tree is None
                  else _tree_hidden(plan.tree, i, n_kv, q.device))
        out[q0:q1] = with_sinks(*_partial(spec, q[q0:q1].to(work), k, v, hidden), sinks).to(q.dtype)
    return out


def _hidden(group, q_end: int, q_len: int, k_first: int, k_end: int, device) -> torch.Tensor | None:
    """[q_len, k_end - k_first] bool: the keys (positions k_first..k_end - 1) each query (positions
    q_end - q_len..q_end - 1) may not see in `group` (its causal mask and window); None: all seen."""
    if not group.causal:
        return None
    q_pos = torch.arange(q_end - q_len, q_end, device=device)[:, None]
    k_pos = torch.arange(k_first, k_end, device=device)[None, :]
    hidden = k_pos > q_pos
    if group.kind is Kind.WINDOW:
        hidden |= k_pos <= q_pos - group.window
    return hidden


def _tree_hidden(tree, request: int, n_kv: int, device) -> torch.Tensor:
    """[n, n_kv] bool for request `request` of a token-tree step (full causal groups only): every cached key
    seen, and of the n new keys (the last n) only each token's ancestors and itself (DraftTree.visible)."""
    visible = torch.from_numpy(tree.visible(request))
    n = visible.shape[0]
    hidden = torch.zeros(n, n_kv, dtype=torch.bool)
    hidden[:, n_kv - n :] = ~visible
    return hidden.to(device)


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets, from each one's output o [T, H, D] and log-sum-exp of its
    logits lse [T, H] (natural log, -inf for no keys): the output over their union and its lse."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    return (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None], m + torch.log(total)


def _partial(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, H, D] over k, v [n, H, D] (hidden [t, n] or None): output [t, H, D] and lse [t, H]."""
    logits = torch.einsum("qhd,khd->hqk", q, k) * spec.sm_scale
    if spec.soft_cap > 0:
        logits = spec.soft_cap * torch.tanh(logits / spec.soft_cap)
    if hidden is not None:
        logits = logits.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [H, t]
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v), lse.transpose(0, 1)


def _attend_cascade(plan: AttentionPlan, q: torch.Tensor, cache: PagedKVCache, group: int,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`_attend` in the two levels of plan.cascade (metadata/cascade.py): each prefix group's
    queries over its shared pages at once (every key visible), each request's queries over its own
    suffix (causal: bottom-right aligned), merged by log-sum-exp (merge_states). Reads only the
    CascadePlan's level arrays, the ones the GPU backend uploads."""
    spec, c, grp = plan.spec, plan.cascade, plan.groups[group].group
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = spec.num_qo_heads // spec.num_kv_heads
    rows = torch.tensor(c.query_order, device=q.device, dtype=torch.long)
    ql = q[rows].to(work)  # level order
    out = torch.zeros_like(ql)[..., : spec.head_dim]
    lse = torch.full(q.shape[:2], float("-inf"), dtype=work, device=q.device)

    def keys(indptr, indices, j: int, n: int):  # the first n tokens of list j
        pages = torch.tensor(indices[indptr[j] : indptr[j + 1]], device=q.device, dtype=torch.long)
        return (x[:n].repeat_interleave(rep, dim=1) for x in cache.read(pages, work))

    for g in range(c.num_groups):  # the shared level
        a, b = int(c.shared_qo_indptr[g]), int(c.shared_qo_indptr[g + 1])
        n = int(c.shared_kv_indptr[g + 1] - c.shared_kv_indptr[g]) * spec.page_size
        k, v = keys(c.shared_kv_indptr, c.shared_kv_indices, g, n)
        out[a:b], lse[a:b] = _partial(spec, ql[a:b], k, v, None)
    for j in range(plan.batch_size):  # the suffix level, merged into the shared one
        a, b, n = int(c.suffix_qo_indptr[j]), int(c.suffix_qo_indptr[j + 1]), int(c.suffix_kv_lens[j])
        k, v = keys(c.suffix_kv_indptr, c.suffix_kv_indices, j, n)
        o2, l2 = _partial(spec, ql[a:b], k, v, _hidden(grp, n, b - a, 0, n, q.device))
        out[a:b], lse[a:b] = merge_states(out[a:b], lse[a:b], o2, l2)
    result = q.new_zeros(q.shape[0], q.shape[1], spec.head_dim)
    result[rows] = with_sinks(out, lse, sinks).to(q.dtype)  # (sinks once, after the levels merged)
    return result
