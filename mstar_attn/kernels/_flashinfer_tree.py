"""FlashInfer's token-tree verify steps (plan.tree): paged prefill with a custom mask.

Each token attends to its request's cached prefix and to its ancestors and itself among the new tokens
(metadata/tree.py). FlashInfer takes that as a packed bit mask over each request's [q, kv] (layout:
kernels/_tree_mask.py), built at commit on the device by one Triton launch from the step's device
arrays and the ancestor sets staged with the step (8 bytes per token), then handed to the wrapper's
plan() outside any graph. Verify replays as a CUDA graph per (slot, group, bucket, tree size):

- a bucketed step (every tree the same size, the batch padded to a bucket; a padding request's tokens
  form a chain over the scratch page) plans a graph-mode prefill wrapper over the slot's buffers and
  two of this module's: the packed mask (`mask`, sized for the pool's largest tree step) and its
  per-request byte offsets (`mask_indptr`). FlashInfer's plan() computes those offsets in bits where
  the kernel reads bytes (it packs each request's segment from a byte boundary), so they are written
  after plan(), into the buffer this module owns and the wrapper reads;
- any other tree step plans an eager prefill wrapper of its own (a wrapper that has run a custom mask
  keeps FlashInfer's FA2 kernels), with the unpacked mask: FlashInfer packs it, reading its size back
  from the device (one synchronization per such step).

Where Triton does not run, the mask is built on the host (`_tree_mask.host_mask`) and copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flashinfer
import numpy as np
import torch

from mstar_attn.kernels import _tree_mask
from mstar_attn.metadata.tree import MAX_TREE_NODES

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep


class TreeState:
    """The tree-step wrappers and mask buffers of one pool's FlashInfer PoolState (`state`): per slot a
    pinned and a device staging of the ancestor sets [max tokens] int64 and the byte offsets [max batch + 1]
    int32; per (slot, group), made at its first bucketed tree step, the packed mask buffer and its offsets."""

    def __init__(self, state):
        self.state, pool = state, state.pool
        self.max_tokens = min(pool.max_num_tokens, max(pool.buckets) * MAX_TREE_NODES)
        self.max_kv = pool.max_pages_per_request * pool.spec.page_size
        n, B = pool.max_num_tokens, pool.max_batch_size
        self.bits_host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(pool.num_slots)]
        self.seg_host = [torch.zeros(B + 1, dtype=torch.int32, pin_memory=True) for _ in range(pool.num_slots)]
        self.bits_dev = [torch.zeros(n, dtype=torch.int64, device=pool.device) for _ in range(pool.num_slots)]
        self.masks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, group) -> (mask, mask_indptr)

    def mask_bytes(self) -> int:
        """A (slot, group)'s packed mask buffer: the largest bucketed tree step's tokens over the longest
        KV a request holds, a byte of rounding per request, and 16 bytes of tail."""
        return self.max_tokens * self.max_kv // 8 + self.state.pool.max_batch_size + 16

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this state owns (the wrappers hold the masks: counted here, not as theirs)."""
        return [*self.bits_host, *self.seg_host, *self.bits_dev, *(t for pair in self.masks.values() for t in pair)]

    def memory(self) -> dict[str, tuple[int, int]]:
        staging = sum(t.numel() * t.element_size() for t in (*self.bits_host, *self.seg_host))
        dev = sum(t.numel() * 8 for t in self.bits_dev)
        masks = sum(m.numel() + i.numel() * 4 for m, i in self.masks.values())
        return {"flashinfer tree masks and staging": (dev + masks, staging)}

    def plan(self, step: DeviceStep, g: int):
        """Group g's wrapper for tree step `step`, planned with its mask."""
        state, spec = self.state, self.state.pool.spec
        dg, s, R = step.groups[g], step.slot, step.padded_batch_size
        q = np.diff(step.host_qo_indptr[: R + 1].numpy())
        kv = dg.host_kv_lens[:R].numpy()
        host_bits, bits = self._stage_bits(step)
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        if step.bucket is None:
            w = state.eager(("tree", s, g), flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            seg = np.concatenate([[0], np.cumsum(q.astype(np.int64) * kv)])
            flat = self._build(step, dg, (q, kv, host_bits), bits, seg, packed=False)
            w.plan(step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads,
                   spec.page_size, custom_mask=flat, seq_lens=dg.host_kv_lens, **state.plan_kwargs)
            state.planned_into(s, g, w)
            return w
        seg = _tree_mask.byte_indptr(q, kv)
        if int(seg[-1]) + 16 > self.mask_bytes():
            raise RuntimeError(f"tree mask of {int(seg[-1])} bytes past its buffer ({self.mask_bytes()})")
        mask, mask_indptr = self._buffers(s, g)
        key = ("tree graph", s, g, R, step.q_len)
        w = state.wrappers.get(key)
        if w is None:
            w = state.wrappers[key] = state.share(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                state.float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=step.qo_indptr,
                paged_kv_indptr_buf=dg.kv_indptr, paged_kv_indices_buf=state.pool.index_buffer(step, g),
                paged_kv_last_page_len_buf=dg.kv_last_page_len, custom_mask_buf=mask,
                mask_indptr_buf=mask_indptr[: R + 1]), s, g)
        packed = self._build(step, dg, (q, kv, host_bits), bits, seg, packed=True)
        w.plan(step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads, spec.page_size,
               packed_custom_mask=packed, seq_lens=dg.host_kv_lens, **state.plan_kwargs)
        # plan() wrote bit offsets into the wrapper's mask_indptr (ours): the kernel reads byte offsets
        host = self.seg_host[s][: R + 1]
        host.numpy()[:] = seg
        mask_indptr[: R + 1].copy_(host, non_blocking=True)
        state.planned_into(s, g, w)
        return w

    def _stage_bits(self, step: DeviceStep) -> tuple[np.ndarray, torch.Tensor]:
        """The step's ancestor sets [padded_num_tokens] (a padding request's tokens: a chain): the slot's
        pinned staging (uint64 numpy view; reused once the slot's next commit finds it free) and its int64
        device copy."""
        plan, s = step.plan, step.slot
        T, N = plan.num_tokens, step.padded_num_tokens
        host = self.bits_host[s].numpy()
        host[:T] = plan.tree.masks.view(np.int64)
        if N > T:
            pad = (np.uint64(2) << np.arange(step.q_len, dtype=np.uint64)) - np.uint64(1)  # token j: tokens 0..j
            host[T:N] = np.tile(pad.view(np.int64), (N - T) // step.q_len)
        dev = self.bits_dev[s][:N]
        dev.copy_(self.bits_host[s][:N], non_blocking=True)
        return host[:N].view(np.uint64), dev

    def _build(self, step: DeviceStep, dg, lengths: tuple, bits: torch.Tensor, seg: np.ndarray,
               packed: bool) -> torch.Tensor:
        """A new device tensor holding the mask (packed uint8 or unpacked bool). lengths: the host q_lens [R],
        kv_lens [R] and ancestor sets [N] uint64 (padding included); bits: the latter on the device; seg
        [R+1]: the segments' offsets (bytes packed, else bits)."""
        n, dev = int(seg[-1]), self.state.pool.device
        out = torch.empty(n, dtype=torch.uint8 if packed else torch.bool, device=dev)
        if not _tree_mask.available():  # (the host builder: O(total bits) on the host, then one copy)
            return out.copy_(torch.from_numpy(_tree_mask.host_mask(*lengths, packed)))
        seg_t = torch.from_numpy(seg.astype(np.int32)).to(dev, non_blocking=True)
        _tree_mask.pack(step.qo_indptr, dg.kv_lens, seg_t, bits, out, int(np.diff(seg).max()), packed)
        return out

    def _buffers(self, s: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.masks.get((s, g))
        if found is None:
            pool = self.state.pool
            found = self.masks[(s, g)] = (torch.zeros(self.mask_bytes(), dtype=torch.uint8, device=pool.device),
                                          torch.zeros(pool.max_batch_size + 1, dtype=torch.int32, device=pool.device))
        return found
