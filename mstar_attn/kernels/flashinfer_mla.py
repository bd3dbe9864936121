"""FlashInfer latent attention (MLA, AttentionSpec.mla_rope_dim > 0): backend "flashinfer_mla".

`flashinfer.mla.BatchMLAPagedAttentionWrapper` (FlashInfer 0.7.2.post1) in the absorbed form for
every mode: q [T, H, head_dim + rope] ([q_nope | q_pe], its "packed" query layout, read through
strided views), the cache's two tensors as its "split" cache layout (c_kv [P, ps, head_dim], k_pe
[P, ps, rope]: our [P, ps, 1, d] tensors viewed rank 3), output [T, H, head_dim]. On Hopper its
"auto" backend plans FA3 (FA2 where FA3 cannot). What this relies on (notes/library_apis.md s. 8):
  - plan() is host work: it reads qo_indptr, kv_indptr and kv_lens on the host (pinned arrays
    here: a device tensor would be a sync), copies them into the wrapper's buffers, and writes its
    schedule into an int workspace it owns. kv_indices may stay on the device.
  - Page counts must be exactly ceil(kv_len / page_size) per request (build_plan's lists are; a
    draft round's, which list pages ahead, are not: refused at commit).
  - Graph mode: FA2/FA3 wrappers may be re-planned between replays; the launch grid's cluster size
    (2 when q_len * heads > 64 per request, else 1) is frozen at capture, and is the same for every
    plan of one (rows, q_len) bucket because padding requests have the step's q_len.
  - Causal masks are bottom-right aligned, sm_scale multiplies q_nope . c_kv + q_pe . k_pe.
Bucketed steps (decode, verify) use graph-mode wrappers over the step's device buffers, one per
(slot, group, rows, q_len), re-planned at each commit; other steps one eager wrapper per (slot,
group) (FlashInfer then allocates its 8 MiB int workspaces at every plan: prefill-sized work).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

from mstar_attn.cache import PagedKVCache
from mstar_attn.kernels import _check
from mstar_attn.kernels._common import write_kv  # noqa: F401  (this backend's write_kv: c_kv as K, k_pe as V)
from mstar_attn.kernels.base import PoolStateBase
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView
    from mstar_attn.capture.step import DeviceStep

MAX_QUERY_TILES = 8192  # FlashInfer MLA plans at most 16384 work items (query tiles of 64 rows plus KV splits)


class PoolState(PoolStateBase):
    """The pool's MLA wrappers, planned at commit from pinned host arrays (see the module doc).
    Memory: a float workspace of pool.float_workspace_bytes (128 MiB by default; FlashInfer needs
    ~17 MiB on an H100 for MLA's partial outputs), and per wrapper FlashInfer's own 8 MiB device +
    8 MiB pinned int workspace. Host cost not yet measured: FlashInfer builds a backend object per
    plan() and, in graph mode, clones its int workspace and metadata buffers for rollback."""

    def __init__(self, pool: PoolView):
        spec = pool.spec
        if pool.device.type != "cuda":
            raise PlanError(f"GraphBufferPool(device={pool.device}): the FlashInfer MLA backend runs on CUDA")
        # (what FlashInfer MLA cannot express, soft cap, windows, rope and head shapes, the spec refused already)
        self.pool = pool
        self.float_ws = torch.zeros(pool.float_workspace_bytes, dtype=torch.uint8, device=pool.device)
        self.wrappers: dict[tuple, BatchMLAPagedAttentionWrapper] = {}
        self.plan_kwargs = dict(num_heads=int(spec.num_qo_heads), head_dim_ckv=int(spec.head_dim),
                                head_dim_kpe=int(spec.mla_rope_dim), page_size=int(spec.page_size),
                                sm_scale=float(spec.sm_scale), q_data_type=spec.dtype, kv_data_type=spec.dtype,
                                kv_cache_layout="split")

    def check(self, plan: AttentionPlan, bucket: int | None) -> None:
        """PlanError before any state changes for what FlashInfer's MLA planner would refuse mid-commit:
        draft-round steps (their page lists run ahead of each step's length) and steps past its work
        list (16384 items of query tiles plus KV splits: we allow query tiles of 64 rows up to half)."""
        if plan.draft_step is not None:
            raise PlanError("commit: backend 'flashinfer_mla' does not serve draft rounds (their page lists run "
                            "ahead of each step's length; FlashInfer MLA takes exactly ceil(kv_len / page_size) pages)")
        tiles = int((-(-plan.q_lens.astype(np.int64) * plan.spec.num_qo_heads // 64)).sum())
        if tiles > MAX_QUERY_TILES:
            raise PlanError(f"commit: {plan.num_tokens} tokens x {plan.spec.num_qo_heads} heads make {tiles} query tiles, over "
                            f"the {MAX_QUERY_TILES} FlashInfer MLA's work list leaves room for: split the step")

    def memory(self) -> dict[str, tuple[int, int]]:
        n = len(self.wrappers)
        return {"flashinfer MLA float workspace": (self.float_ws.numel(), 0),
                f"flashinfer MLA int workspaces ({n} wrappers, FlashInfer's own)": (n * (8 << 20), n * (8 << 20))}

    def schedule(self, step: DeviceStep) -> tuple:
        """One planned wrapper per layer group."""
        return tuple(self._plan(step, g, dg) for g, dg in enumerate(step.groups))

    def _plan(self, step: DeviceStep, g: int, dg):
        causal = self.pool.spec.groups[g].causal
        if step.bucket is not None:
            key = ("graph", step.slot, g, step.padded_batch_size, step.q_len)
            w = self.wrappers.get(key)
            if w is None:  # over the step's own buffers: a graph captured on it replays the latest plan
                w = self.wrappers[key] = BatchMLAPagedAttentionWrapper(
                    self.float_ws, use_cuda_graph=True, qo_indptr=step.qo_indptr, kv_indptr=dg.kv_indptr,
                    kv_indices=self.pool.index_buffer(step, g), kv_len_arr=dg.kv_lens)
        else:
            key = ("eager", step.slot, g)
            w = self.wrappers.get(key)
            if w is None:
                w = self.wrappers[key] = BatchMLAPagedAttentionWrapper(self.float_ws)
        meta = MLAPlanMetadata.csr(step.host_qo_indptr, dg.host_kv_indptr, dg.listed(), dg.host_kv_lens)
        w.plan(metadata=meta, causal=bool(causal), **self.plan_kwargs)
        return w


def run(step: DeviceStep, q: torch.Tensor, cache: PagedKVCache, group: int | None = None,
        k: torch.Tensor | None = None, v: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Latent attention for one layer of layer group `group` (default 0).

    q: [T, heads, head_dim + mla_rope_dim] ([q_nope absorbed through W_UK | q_pe]), spec.dtype, on
    the cache's device; a bucketed step also takes its padding requests' rows (DeviceStep.accepts_rows).
    cache: c_kv as k [P, ps, 1, head_dim], k_pe as v [P, ps, 1, mla_rope_dim] (write_kv stores them).
    Returns [q rows, heads, head_dim] (softmax . c_kv; apply W_UV after). k, v: unused.
    """
    plan = _check.step_plan(step, "run")
    group = _check.layer_group(group, plan, "run")
    _check.sinks(sinks, plan, group, q, "run")  # (none: this backend serves no sink group, Capabilities.sinks)
    _check.cache_fits(cache, plan, "run", step=step, group=group)
    _check.query(q, step, plan, cache, "run")
    _check.stored_first(step, k, v, cache, group, "run")
    rows = q.shape[0]
    if rows < step.padded_num_tokens:  # eager call on a bucket-padded step: the wrapper was planned for all rows
        q = torch.cat([q, q[:1].expand(step.padded_num_tokens - rows, -1, -1)])
    P, ps = cache.k.shape[0], cache.k.shape[1]
    kv = (cache.k.view(P, ps, cache.k.shape[-1]), cache.v.view(P, ps, cache.v.shape[-1]))
    return step.scheduled[group].run(query=q, kv_cache=kv)[:rows]
