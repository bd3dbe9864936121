"""FlashInfer backend (the default): paged decode / prefill / extend / verify, ragged prefill.

Host-side scheduling (`wrapper.plan`) runs in `GraphBufferPool.commit`, through `Scheduler`,
from pinned host arrays (indptr, last_page_len, kv lens) and the slot's device page indices:
no device-to-host copy, never inside a graph. `run` and `write_kv` only launch kernels.
Uses FlashInfer's public wrapper API only (pinned to 0.7.2; tests/kernels/test_flashinfer.py
checks the signatures this module calls).
"""

from __future__ import annotations

import flashinfer
import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.pool import DeviceStep, GraphBufferPool
from mstar_attn.metadata.plan import Mode

FLOAT_WORKSPACE_BYTES = 256 << 20


class Scheduler:
    """The pool's FlashInfer wrappers, keyed by (kind, slot, group, rows), planned at commit.

    Decode wrappers for bucketed batches run in CUDA-graph mode over the slot's own device
    buffers, so a graph captured on them replays whatever the latest commit planned. The float
    workspace is shared (kernels of one stream never overlap); each wrapper keeps its own int
    workspace, which holds its plan.
    """

    def __init__(self, pool: GraphBufferPool, ragged_prefill: bool = False):
        self.pool = pool
        self.ragged_prefill = ragged_prefill
        self.float_ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.tensor_cores = pool.spec.gqa_group >= 4  # FlashInfer's advice for decode
        self.wrappers: dict[tuple, object] = {}
        spec = pool.spec
        self.plan_kwargs = dict(  # the same for every plan() call of this pool
            logits_soft_cap=spec.soft_cap or None, q_data_type=spec.dtype, kv_data_type=spec.dtype,
            sm_scale=spec.sm_scale, non_blocking=True,
        )

    def _wrapper(self, kind: str, step: DeviceStep, g: int):
        graph = kind == "decode" and step.bucket is not None
        key = (kind, step.slot, g, step.rows if graph else None)
        w = self.wrappers.get(key)
        if w is not None:
            return w
        if kind == "decode" and graph:
            o_ptr, o_lpl, _, o_idx = self.pool.layout.group(g)
            dev, rows = self.pool.dev[step.slot], step.rows
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.float_ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=dev[o_ptr : o_ptr + rows + 1],
                paged_kv_indices_buffer=dev[o_idx : o_idx + self.pool.layout.max_pages],
                paged_kv_last_page_len_buffer=dev[o_lpl : o_lpl + rows],
            )
        elif kind == "decode":
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.float_ws, "NHD", use_tensor_cores=self.tensor_cores)
        elif kind == "ragged":
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.float_ws, "NHD")
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.float_ws, "NHD")
        self.wrappers[key] = w
        return w

    def schedule(self, step: DeviceStep) -> tuple:
        spec, common = self.pool.spec, self.plan_kwargs
        out = []
        for g, (group, dg) in enumerate(zip(spec.groups, step.groups)):
            if step.mode is Mode.DECODE:
                w = self._wrapper("decode", step, g)
                w.plan(dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, spec.num_qo_heads, spec.num_kv_heads,
                       spec.head_dim, spec.page_size, window_left=group.window_left, seq_lens=dg.host_kv_lens, **common)
            elif step.mode is Mode.PREFILL and self.ragged_prefill:
                w = self._wrapper("ragged", step, g)
                w.plan(step.host_qo_indptr, step.host_qo_indptr, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                       causal=group.causal, window_left=group.window_left, **common)
            else:
                w = self._wrapper("prefill", step, g)
                w.plan(step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, spec.num_qo_heads,
                       spec.num_kv_heads, spec.head_dim, spec.page_size, causal=group.causal,
                       window_left=group.window_left, seq_lens=dg.host_kv_lens, **common)
            out.append(w)
        return tuple(out)


def write_kv(step: DeviceStep, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache) -> None:
    """Store the step's new K/V: k, v [T or num_rows, kv_heads, head_dim] on the cache's device.

    Row t goes to slot step.slot_mapping[t]; padding rows rewrite row 0's values onto row 0's
    slot, so the write is graph-safe at a fixed bucket size and never touches another page.
    """
    k_flat, v_flat = cache.flat()
    k_flat.index_copy_(0, step.slot_mapping, k.index_select(0, step.write_src))
    v_flat.index_copy_(0, step.slot_mapping, v.index_select(0, step.write_src))


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
            raise ValueError("run: this pool plans prefill as ragged attention; pass the step's k and v")
        return w.run(q, k, v)
    rows = q.shape[0]
    if rows < step.num_rows:  # eager call on a bucket-padded decode step
        q = torch.cat([q, q[:1].expand(step.num_rows - rows, -1, -1)])
    return w.run(q, (cache.k, cache.v))[:rows]
