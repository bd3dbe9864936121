"""Shared-prefix (cascade) steps on FlashInfer: the pool's state for them and their `run`.

A cascade step (AttentionPlan.cascade, metadata/cascade.py) runs each layer of a cascade group as
    qp = q[rows]                                  the queries in level order (groups' members first)
    o1, lse1 = prefill(qp, shared runs)           non-causal, one request per prefix group (side stream)
    o2, lse2 = decode(qp, suffixes)               each request's own pages (the caller's stream)
    o2[:M] = merge(o2, lse2, o1, lse1)            masked to the M member rows (flashinfer.merge_state_in_place)
    out = o2[inv]                                 back to batch order
The two levels are independent, so the shared level (tensor-core arithmetic over few CTAs) runs
on a side stream beside the suffix level (bandwidth): with its own float and int workspaces.
Bucketed steps (decode, verify) use graph-mode wrappers with fixed buffers, so a captured graph
replays any later cascade commit: the shared level's batch is padded to rows // 2 + 1 requests
(a prefix group has 2+ members): the real groups, empty ones, then one "rest" request that holds
the rows of requests in no group (and the bucket's padding rows) over the scratch page, so the
prefill's row count is fixed too; the merge mask drops the rest. FlashInfer's LSE is base 2 in
both levels, which is all the merge needs. Imports no GPU package at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np
import torch

from mstar_attn.kernels._common import with_sinks
from mstar_attn.kernels._flashinfer_fast import share_workspace
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep
    from mstar_attn.capture.view import PoolView

INT_WORKSPACE_BYTES = 8 << 20


def staging_entries(layout) -> int:
    """int32 entries of a slot's staging buffer: what `stage` writes for the largest step the pool's
    layout admits (3 x token rows, 3 x (rows / 2 + 2) + 3 x rows + 2 arrays, two index lists)."""
    groups = layout.max_rows // 2 + 1
    return 3 * layout.max_tokens + 5 * groups + 4 * layout.max_rows + 8 + 2 * layout.index_capacity


def shared_batch(step: DeviceStep) -> int:
    """The shared level's request count: a bucketed step's fixed rows // 2 + 1 (a prefix group has 2+
    members, and one "rest" request), else its groups + 1."""
    return step.padded_batch_size // 2 + 1 if step.bucket is not None else step.plan.cascade.num_groups + 1


def shared_workspace_bytes(pool) -> int:
    """A bound on the float workspace the shared level's prefill plan takes: in graph mode FlashInfer
    always splits KV and keeps partial outputs (float32, head_dim wide) and LSEs for every query-tile
    row of its padded work list, about (R x gqa + (groups + 1) x 128) packed rows of at most R =
    max_rows x MAX_VERIFY_Q_LEN query rows (bounded by the pool's token rows), twice for slack."""
    spec, L = pool.spec, pool.layout
    R = min(L.max_tokens, L.max_rows * MAX_VERIFY_Q_LEN)
    packed = R * spec.gqa_group + (L.max_rows // 2 + 2) * 128
    rows = -(-packed // spec.gqa_group)
    return 2 * spec.num_qo_heads * rows * (spec.head_dim + 1) * 4 + (16 << 20)


@attrs.frozen
class Levels:
    """One committed cascade step's device arrays (int32 views of the slot's region) and its wrappers.
    perm [num_rows], inv [num_rows]: level order <-> batch order; mask [num_rows] bool: member rows."""

    perm: torch.Tensor
    inv: torch.Tensor
    mask: torch.Tensor
    shared: object
    suffix: object
    state: CascadeState = attrs.field(repr=False)


class WorkspaceOwner(Protocol):
    """What CascadeState reads of FlashInfer's PoolState, which makes it (kernels/flashinfer.py): the pool's view,
    the float workspace and planning keywords its wrappers share, whether decode runs on tensor cores, and the
    slot and group int workspaces (share a wrapper into one)."""

    pool: PoolView
    float_ws: torch.Tensor
    plan_kwargs: dict
    tensor_cores: bool

    def share(self, w, slot: int, g: int, draft: int | None = None): ...


class CascadeState:
    """FlashInfer's pool state (its PoolState) for cascade steps, made when the spec has cascade on.

    Per slot: a pinned int32 staging buffer and its device twin, filled at commit with the step's
    level arrays (one host-to-device copy); per (slot, kind) the two levels' page-index buffers
    (graph-mode wrappers copy their indices there at plan time) and the shared level's int workspace;
    per pool one float workspace and one side stream for the shared level. Cascade groups of one kind
    (causal or not) read the same levels with the same kernels, so a step plans once per kind, through
    the wrappers of its first group (`rep`), and its groups share one Levels.
    Memory: slots x (staging 2 x (3 x max_tokens + 7 x max_rows + 2 x index_capacity) x 4 bytes,
    pinned + device) + slots x kinds x (2 x (index_capacity + max_rows / 2) x 4 + 8 MiB device + 8 MiB pinned)
    + the float workspace (the pool's float_workspace_bytes, or shared_workspace_bytes if larger).
    """

    def __init__(self, owner: WorkspaceOwner):
        pool = self.pool = owner.pool
        self.owner, L = owner, pool.layout
        self.max_groups = L.max_rows // 2 + 1
        cap = L.index_capacity
        import flashinfer

        self.fi = flashinfer
        self.size = staging_entries(L)
        spec = pool.spec
        firsts = {}  # kind (causal) -> its first cascade group
        self.rep = {g: firsts.setdefault(spec.groups[g].causal, g) for g in spec.cascade_groups}
        groups = sorted(firsts.values())
        self.host = [torch.zeros(self.size, dtype=torch.int32, pin_memory=True) for _ in range(pool.num_slots)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = [torch.zeros(self.size, dtype=torch.int32, device=pool.device) for _ in range(pool.num_slots)]
        self.indices = {(s, g, level): torch.zeros(cap + self.max_groups, dtype=torch.int32, device=pool.device)
                        for s in range(pool.num_slots) for g in groups for level in (0, 1)}
        self.int_ws = {(s, g): (torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device),
                                torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True))
                       for s in range(pool.num_slots) for g in groups}
        self.float_ws = torch.zeros(max(pool.float_workspace_bytes, shared_workspace_bytes(pool)), dtype=torch.uint8,
                                    device=pool.device)
        self.side = torch.cuda.Stream(pool.device)
        self.wrappers: dict[tuple, object] = {}

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this state allocated (its wrappers share them): for the memory report."""
        return [*self.host, *self.dev, *self.indices.values(), *(t for pair in self.int_ws.values() for t in pair), self.float_ws]

    def memory(self) -> dict[str, tuple[int, int]]:
        staging = sum(h.numel() * 4 for h in self.host)
        idx = sum(t.numel() * 4 for t in self.indices.values())
        ws = sum(d.numel() for d, _ in self.int_ws.values())
        return {"cascade staging + indices": (staging + idx, staging), "cascade workspaces": (ws + self.float_ws.numel(), ws)}

    def schedule(self, step: DeviceStep) -> dict[int, Levels]:
        """Stage and upload the step's level arrays (padded to its bucket), plan both levels' wrappers
        once per kind of cascade group; one Levels per cascade group (shared within a kind)."""
        plan, spec = step.plan, step.plan.spec
        ps = spec.page_size
        Gf = shared_batch(step)
        r = stage(self.host_np[step.slot], plan.cascade, plan.batch_size, step.padded_batch_size, step.padded_num_tokens, step.q_len, Gf, spec)
        at = r["shared_kv_indices"][1]
        perm, inv, mask, s_qo, s_ptr, s_lpl, s_len, x_ptr, x_lpl, x_len, x_idx, s_idx = r.values()
        R = step.padded_num_tokens
        host, dev = self.host[step.slot], self.dev[step.slot]
        self.pool.upload(dev[:at], host[:at])

        def view(r, on=dev):
            return on[r[0] : r[1]]

        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        kw = self.owner.plan_kwargs
        out = {}
        c = plan.cascade
        for g in sorted(set(self.rep.values())):
            grp = spec.groups[g]
            shared = self._shared(step, g, Gf)
            shared.plan(view(s_qo, host), view(s_ptr, host), view(s_idx), view(s_lpl, host), *heads, ps,
                        causal=False, seq_lens=view(s_len, host), **kw)
            suffix = self._suffix(step, g)
            if step.mode.value == "decode" or step.bucket is not None:
                suffix.plan(view(x_ptr, host), view(x_idx), view(x_lpl, host), *heads, ps, seq_lens=view(x_len, host),
                            **({"q_len_per_req": step.q_len} if step.bucket is not None else {}), **kw)
            else:  # an unbucketed verify step: causal prefill over the suffixes (bottom-right aligned)
                qo = torch.from_numpy(c.suffix_qo_indptr.copy())
                suffix.plan(qo, view(x_ptr, host), view(x_idx), view(x_lpl, host), *heads, ps, causal=grp.causal,
                            seq_lens=view(x_len, host), **kw)
            out[g] = Levels(view(perm), view(inv), view(mask).view(torch.uint8)[:R].view(torch.bool), shared, suffix, self)
        return {g: out[rep] for g, rep in self.rep.items()}

    def _shared(self, step: DeviceStep, g: int, Gf: int):
        graph = step.bucket is not None
        key = ("shared", step.slot, g) + ((step.padded_batch_size, step.q_len) if graph else ())
        w = self.wrappers.get(key)
        if w is None:
            buffers = {}
            if graph:
                dev = self.pool.device
                buffers = dict(use_cuda_graph=True, qo_indptr_buf=torch.zeros(Gf + 1, dtype=torch.int32, device=dev),
                               paged_kv_indptr_buf=torch.zeros(Gf + 1, dtype=torch.int32, device=dev),
                               paged_kv_indices_buf=self.indices[(step.slot, g, 0)],
                               paged_kv_last_page_len_buf=torch.zeros(Gf, dtype=torch.int32, device=dev))
            # fa2: FlashInfer's SM90 (fa3) paged prefill splits no KV in graph mode: 2.6x slower here (H100 probe)
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.float_ws, "NHD", backend="fa2", **buffers)
            share_workspace(w, self.float_ws, *self.int_ws[(step.slot, g)])
            self.wrappers[key] = w
        return w

    def _suffix(self, step: DeviceStep, g: int):
        sch, graph, flashinfer = self.owner, step.bucket is not None, self.fi
        key = ("suffix", step.slot, g) + ((step.padded_batch_size, step.q_len) if graph else (step.mode.value,))
        w = self.wrappers.get(key)
        if w is None:
            dev = self.pool.device
            if graph:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    sch.float_ws, "NHD", use_cuda_graph=True, use_tensor_cores=sch.tensor_cores or step.q_len > 1,
                    paged_kv_indptr_buffer=torch.zeros(step.padded_batch_size + 1, dtype=torch.int32, device=dev),
                    paged_kv_indices_buffer=self.indices[(step.slot, g, 1)],
                    paged_kv_last_page_len_buffer=torch.zeros(step.padded_batch_size, dtype=torch.int32, device=dev))
            elif step.mode.value == "decode":
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(sch.float_ws, "NHD", use_tensor_cores=sch.tensor_cores)
            else:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(sch.float_ws, "NHD")
            self.wrappers[key] = sch.share(w, step.slot, g)  # the slot and group's int workspace (planned at every commit)
        return w


def stage(h: np.ndarray, c, B: int, rows: int, R: int, q_len: int, Gf: int, spec) -> dict[str, tuple[int, int]]:
    """Write a step's level arrays (CascadePlan c of B requests, padded to `rows` requests and R
    query rows; q_len: a padding request's tokens) into the int32 buffer h from 0 on; returns each
    array's [start, end) in h, in this order:
      perm [R], inv [R]            level row j is batch row perm[j]; inv inverts it (padding rows stay put)
      mask [ceil(R / 4)]           bytes: 1 for the M = c.member_queries rows of groups
      shared_qo_indptr [Gf+1]      the G groups, then empty ones, then the "rest" request: rows M..R
      shared_kv_indptr [Gf+1], shared_last_page_len [Gf], shared_kv_lens [Gf]
      suffix_kv_indptr [rows+1], suffix_last_page_len [rows], suffix_kv_lens [rows]
      suffix_kv_indices, shared_kv_indices   (padding requests, empty groups, rest: the scratch page)
    Pure numpy; Gf >= G + 1; spec: the AttentionSpec (its page size and scratch page)."""
    G, T, ps, scratch = c.num_groups, int(c.query_order.shape[0]), spec.page_size, spec.scratch_page
    pad_pages = -(-q_len // ps)  # a padding request reads q_len tokens of the scratch page
    out, at = {}, 0

    def put(name, values, n=None):  # the next n entries (default len(values))
        nonlocal at
        n = len(values) if n is None else n
        h[at : at + len(values)] = values
        out[name] = (at, at + n)
        at += n
        return h[at - n : at]

    perm = put("perm", c.query_order, R)
    perm[T:] = np.arange(T, R)
    put("inv", (), R)[perm] = np.arange(R)
    put("mask", np.zeros(-(-R // 4), np.int32)).view(np.uint8)[: c.member_queries] = 1
    qo = put("shared_qo_indptr", c.shared_qo_indptr, Gf + 1)
    qo[G + 1 :] = c.member_queries
    qo[-1] = R
    n_sh, n_x = int(c.shared_kv_indptr[-1]), int(c.suffix_kv_indptr[-1])
    ptr = put("shared_kv_indptr", c.shared_kv_indptr, Gf + 1)
    ptr[G + 1 :] = n_sh + np.arange(1, Gf - G + 1)  # one scratch page each
    put("shared_last_page_len", np.full(Gf, ps, np.int32))
    put("shared_kv_lens", np.diff(ptr) * ps)
    put("suffix_kv_indptr", c.suffix_kv_indptr, rows + 1)[B + 1 :] = n_x + pad_pages * np.arange(1, rows - B + 1)
    put("suffix_last_page_len", c.suffix_last_page_len, rows)[B:] = q_len - (pad_pages - 1) * ps
    put("suffix_kv_lens", c.suffix_kv_lens, rows)[B:] = q_len
    put("suffix_kv_indices", c.suffix_kv_indices, n_x + pad_pages * (rows - B))[n_x:] = scratch
    put("shared_kv_indices", c.shared_kv_indices, n_sh + Gf - G)[n_sh:] = scratch
    return out


def run(step: DeviceStep, q: torch.Tensor, cache, lv: Levels, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a cascade group: q [rows, qo_heads, head_dim] (a bucketed step's padded rows
    included), spec.dtype, on the cache's device; returns the same shape, in batch order. sinks (float32
    [qo_heads]): applied once, by the merged log-sum-exp."""
    R = lv.perm.shape[0]
    rows = q.shape[0]
    if rows < R:  # an eager call on a bucket-padded step: padding rows read the scratch page
        q = torch.cat([q, q[:1].expand(R - rows, -1, -1)])
    qp = q[lv.perm]  # not index_select: its kernel for <= 16 indices takes 3-5x as long (perm_probe_h100.md)
    o1 = torch.empty_like(qp)
    lse1 = torch.empty(qp.shape[:2], dtype=torch.float32, device=q.device)
    main, side = torch.cuda.current_stream(q.device), lv.state.side
    side.wait_stream(main)
    with torch.cuda.stream(side):
        lv.shared.run(qp, (cache.k, cache.v), out=o1, lse=lse1)
    o2, lse2 = lv.suffix.run(qp, (cache.k, cache.v), return_lse=True)
    main.wait_stream(side)
    lv.state.fi.merge_state_in_place(o2, lse2, o1, lse1, mask=lv.mask)  # (o2, lse2: the merged states)
    return with_sinks(o2, lse2, sinks, lse_base2=True, fused=True)[lv.inv][:rows]
