"""FlashInfer backend (the default): paged decode / prefill / extend / verify, ragged prefill.

Host-side scheduling (`wrapper.plan`) runs in `GraphBufferPool.commit`, through `Scheduler`,
from pinned host arrays (indptr, last_page_len, kv lens) and the slot's device page indices:
no device-to-host copy, never inside a graph. `run` and `write_kv` only launch kernels.
Uses FlashInfer's public wrapper API (tests/kernels/test_flashinfer.py checks the signatures this
module calls), except the re-plan of graph-mode decode wrappers in `_flashinfer_fast` (pinned).
"""

from __future__ import annotations

import flashinfer
import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.pool import DeviceStep, GraphBufferPool
from mstar_attn.kernels._common import write_kv  # noqa: F401  (this backend's write_kv)
from mstar_attn.kernels._flashinfer_fast import FastDecodePlan, supported
from mstar_attn.metadata.plan import Mode

FLOAT_WORKSPACE_BYTES = 256 << 20


class Scheduler:
    """The pool's FlashInfer wrappers, planned at commit from pinned host arrays.

    Bucketed steps (decode, and verify with q_len <= page_size) use graph-mode decode wrappers
    keyed by (slot, group, rows, q_len) over the slot's own device buffers, so a graph captured on
    one replays whatever the latest commit planned; after a wrapper's first public plan() they
    are re-planned through `FastDecodePlan` (the C++ planner alone). Verify uses tensor cores
    (FlashInfer's multi-token decode: causal, bottom-right aligned). Other steps use eager
    wrappers: decode past the largest bucket, paged prefill for prefill / extend / mixed /
    unbucketed verify, ragged prefill when the plan names "flashinfer_ragged". The float
    workspace is shared (kernels of one stream never overlap); each wrapper keeps its own int
    workspace and pinned mirror, which hold its plan, so wrappers are per slot.
    """

    def __init__(self, pool: GraphBufferPool, **_options):
        self.pool = pool
        spec = pool.spec
        self.float_ws = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.tensor_cores = spec.gqa_group >= 4  # FlashInfer's advice for decode
        self.wrappers: dict[tuple, object] = {}
        self.fast: dict[tuple, FastDecodePlan] = {}
        self.use_fast = supported(flashinfer)
        self.plan_kwargs = dict(  # the same for every plan() call of this pool
            logits_soft_cap=spec.soft_cap or None, q_data_type=spec.dtype, kv_data_type=spec.dtype,
            sm_scale=spec.sm_scale, non_blocking=True,
        )

    def schedule(self, step: DeviceStep) -> tuple:
        return tuple(self._plan(step, g, dg) for g, dg in enumerate(step.groups))

    def _plan(self, step: DeviceStep, g: int, dg):
        spec, group = self.pool.spec, self.pool.spec.groups[g]
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        if step.bucket is not None:
            key = (step.slot, g, step.rows, step.q_len)
            fast = self.fast.get(key)
            if fast is not None:
                fast.replan(step.host_qo_indptr, dg.host_kv_indptr, dg.host_kv_lens)
                return fast.wrapper
            w = self.wrappers.get(("graph",) + key)  # one per key for life: captured graphs point into it
            if w is None:
                w = self.wrappers[("graph",) + key] = self._graph_wrapper(step, g)
            w.plan(dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads, spec.page_size,
                   window_left=group.window_left, seq_lens=dg.host_kv_lens, q_len_per_req=step.q_len, **self.plan_kwargs)
            if self.use_fast:
                try:
                    self.fast[key] = FastDecodePlan(w, num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                                                    head_dim=spec.head_dim, page_size=spec.page_size, q_len=step.q_len,
                                                    window_left=group.window_left, soft_cap=float(spec.soft_cap), dtype=spec.dtype)
                except RuntimeError:  # internals not as expected: this wrapper keeps the public plan()
                    pass
            return w
        if step.mode is Mode.DECODE:
            w = self._eager(("decode", step.slot, g), flashinfer.BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=self.tensor_cores)
            w.plan(dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads, spec.page_size,
                   window_left=group.window_left, seq_lens=dg.host_kv_lens, **self.plan_kwargs)
        elif step.plan.backend == "flashinfer_ragged":
            w = self._eager(("ragged", step.slot, g), flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
            w.plan(step.host_qo_indptr, step.host_qo_indptr, *heads, causal=group.causal,
                   window_left=group.window_left, **self.plan_kwargs)
        else:
            w = self._eager(("prefill", step.slot, g), flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            w.plan(step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads,
                   spec.page_size, causal=group.causal, window_left=group.window_left, seq_lens=dg.host_kv_lens,
                   **self.plan_kwargs)
        return w

    def _eager(self, key: tuple, cls, **kw):
        w = self.wrappers.get(key)
        if w is None:
            w = self.wrappers[key] = cls(self.float_ws, "NHD", **kw)
        return w

    def _graph_wrapper(self, step: DeviceStep, g: int):
        o_ptr, o_lpl, _, o_idx = self.pool.offsets[g]
        dev, rows = self.pool.dev[step.slot], step.rows
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.float_ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores or step.q_len > 1,
            paged_kv_indptr_buffer=dev[o_ptr : o_ptr + rows + 1],
            paged_kv_indices_buffer=dev[o_idx : o_idx + self.pool.layout.max_pages],
            paged_kv_last_page_len_buffer=dev[o_lpl : o_lpl + rows],
        )


def run(step: DeviceStep, q: torch.Tensor, cache: PagedKVCache, group: int = 0,
        k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one layer of layer group `group`.

    q: [T or num_rows, qo_heads, head_dim], spec.dtype, on the cache's device; returns the same
    number of rows. k, v: the step's new keys and values [T, kv_heads, head_dim], needed only
    when the pool plans prefill steps as ragged (attention over the new tokens alone).
    """
    w = step.scheduled[group]
    if isinstance(w, flashinfer.BatchPrefillWithRaggedKVCacheWrapper):
        if k is None or v is None:
            raise ValueError("run: this step is planned as ragged attention (flashinfer_ragged); pass its k and v")
        return w.run(q, k, v)
    rows = q.shape[0]
    if rows < step.num_rows:  # eager call on a bucket-padded decode step
        q = torch.cat([q, q[:1].expand(step.num_rows - rows, -1, -1)])
    return w.run(q, (cache.k, cache.v))[:rows]
