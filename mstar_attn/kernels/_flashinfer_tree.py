"""FlashInfer's token-tree verify steps (plan.tree): paged prefill with a custom mask.

Each token attends to its request's cached prefix and to its ancestors and itself among the new tokens
(metadata/tree.py). FlashInfer takes that as a packed bit mask over each request's [q, kv] (layout:
kernels/_tree_mask.py), built at commit on the device by one Triton launch from the step's device
arrays and the ancestor sets staged with the step (8 bytes per token), then handed to the wrapper's
plan() outside any graph. Verify replays as a CUDA graph per (slot, group, bucket, tree size):

- a bucketed step (every tree the same size, at most MAX_VERIFY_Q_LEN tokens, the batch padded to a
  bucket; a padding request's tokens form a chain over the scratch page) plans a graph-mode prefill wrapper
  over the slot's buffers and two of this module's: the packed mask (`mask`, sized for the pool's largest
  bucketed verify step over the longest KV a request holds) and its per-request byte offsets
  (`mask_indptr`). FlashInfer's plan() computes those offsets in bits where the kernel reads bytes (it
  packs each request's segment from a byte boundary), so they are written after plan(), into the buffer
  this module owns and the wrapper reads;
- any other tree step plans an eager prefill wrapper of its own (a wrapper that has run a custom mask
  keeps FlashInfer's FA2 kernels), with the unpacked mask: FlashInfer packs it, reading its size back
  from the device (one synchronization per such step).

The mask is built once per step and shared by the layer groups (tree steps serve full causal groups only:
every group reads the same lengths; a group whose lengths differ gets its own). Its buffers and pinned
staging are made at the pool's first tree step: capture tree graphs on the serving pool
(DecodeGraphs.capture(trees=True)) before serving, so that no allocation falls inside it (warmup(spec, trees=True)
compiles the kernels on a pool of its own). Bucketed steps of many requests plan with split-KV off (as decode
buckets do), which keeps their partial outputs within the shared float workspace. `check` refuses,
before the commit changes anything, a step whose mask would not fit. Where Triton does not run, the mask
is built on the host (`_tree_mask.host_mask`) and copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from mstar_attn.kernels import _tree_mask
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, AttentionPlan

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep

TAIL = 16  # bytes of slack past a packed mask
FIXED_MIN_CTAS_FALLBACK = 264  # requests x KV heads past which bucketed tree steps never split KV (2 CTAs per SM
# of an H100) when the backend's own fixed schedule is off
MAX_UNPACKED_BITS = 1 << 28  # an unbucketed tree step's unpacked mask (one byte per bit on the device): 256 MiB


@attrs.frozen
class StepMask:
    """One step's mask on the device: uint8 packed [bytes] or bool unpacked [bits]; seg [R+1] int32 (pinned):
    each request's segment offset (bytes packed, bits unpacked); kv [R] the lengths it was built for."""

    data: torch.Tensor
    seg: torch.Tensor
    kv: np.ndarray


def _aligned(n: int) -> int:
    """n int32 entries rounded up to 16 bytes."""
    return -(-n // 4) * 4


class TreeState:
    """The tree-step wrappers' mask buffers and staging of one pool's FlashInfer PoolState (`state`): per slot the
    ancestor sets, pinned [max tokens] int64 and on the device; per (slot, group) the mask kernel's lengths and
    segment offsets, int32 [3 x max batch + 12] (each on 16 bytes) pinned and on the device; per (slot, group), made at its first
    bucketed tree step, the packed mask buffer uint8 [mask_bytes] and its byte offsets int32 [max batch + 1] on
    the device."""

    def __init__(self, state):
        self.state, pool = state, state.pool
        n, B, G = pool.layout.max_tokens, pool.layout.max_rows, len(pool.spec.groups)
        self.bits_host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(pool.num_slots)]
        self.bits_dev = [torch.zeros(n, dtype=torch.int64, device=pool.device) for _ in range(pool.num_slots)]
        # the mask kernel's arrays, one copy to the device: qo_indptr [R+1], kv_lens [R], the segments' offsets
        # [R+1] (a StepRows step's device arrays are derived after the backend state schedules: the kernel reads
        # these instead; the offsets also become the wrapper's mask_indptr after plan())
        self.lens_host = [[torch.zeros(3 * B + 12, dtype=torch.int32, pin_memory=True) for _ in range(G)]
                          for _ in range(pool.num_slots)]
        self.lens_dev = [[torch.zeros(3 * B + 12, dtype=torch.int32, device=pool.device) for _ in range(G)]
                         for _ in range(pool.num_slots)]
        self.masks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, group) -> (mask, mask_indptr)

    @staticmethod
    def mask_bytes(pool) -> int:
        """A (slot, group)'s packed mask buffer: the largest bucketed verify step's tokens over the longest KV a
        request holds (bits), a byte of rounding per request, and TAIL bytes."""
        tokens = min(pool.layout.max_tokens, max(pool.buckets, default=0) * MAX_VERIFY_Q_LEN)
        return tokens * pool.max_pages_per_request * pool.spec.page_size // 8 + pool.layout.max_rows + TAIL

    @staticmethod
    def check(pool, plan: AttentionPlan, bucket: int | None) -> None:
        """PlanError unless tree step `plan` (bucket: its padded batch, None: unbucketed) fits: its packed mask
        within the mask buffer (bucketed), its unpacked mask's bit offsets within int32 (unbucketed)."""
        q, kv = plan.q_lens.astype(np.int64), plan.kv_lens.astype(np.int64)
        if bucket is None:
            bits = int((q * kv).sum())
            if bits > MAX_UNPACKED_BITS:
                raise PlanError(f"tree: the step's mask has {bits} bits (sum of q_len x kv_len), more than the "
                                f"{MAX_UNPACKED_BITS} an unbucketed tree step builds unpacked (a byte each): split the step")
            return
        pad = (bucket - plan.batch_size) * -(-plan.max_q_len**2 // 8)  # (padding requests: q_len over q_len tokens)
        need = int(((q * kv + 7) // 8).sum()) + pad + TAIL
        have = min(TreeState.mask_bytes(pool), 2**31 - 1)  # (FlashInfer's mask offsets are int32)
        if need > have:
            i = int(np.argmax(q * kv))
            raise PlanError(f"tree: the step's packed mask needs {need} bytes, more than the pool's {have} (request {i}: "
                            f"{int(q[i])} tokens over {int(kv[i])}); raise max_pages_per_request or lower the batch")

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this state owns (the wrappers hold the masks: counted here, not as theirs)."""
        return [*self.bits_host, *self.bits_dev, *(t for per in (*self.lens_host, *self.lens_dev) for t in per),
                *(t for pair in self.masks.values() for t in pair)]

    def memory(self) -> dict[str, tuple[int, int]]:
        """(device bytes, pinned bytes) of the masks and staging."""
        ts = self.tensors()
        return {"flashinfer tree masks and staging": (sum(t.numel() * t.element_size() for t in ts if t.is_cuda),
                                                      sum(t.numel() * t.element_size() for t in ts if not t.is_cuda))}

    def schedule(self, step: DeviceStep) -> tuple:
        """One wrapper per layer group for tree step `step`, each planned with the step's mask (built once, and
        again only for a group whose lengths differ)."""
        self.state.pool.stage_host(step)  # (a StepRows step's pinned arrays, staged only when a planner reads them)
        host_bits, bits = self._stage_bits(step)
        out, built = [], None
        for g in range(len(step.groups)):
            kv = step.groups[g].host_kv_lens[: step.padded_batch_size].numpy()
            if built is None or not np.array_equal(built.kv, kv):
                built = self._build(step, g, kv, (host_bits, bits))
            out.append(self._plan(step, g, built))
        return tuple(out)

    def _plan(self, step: DeviceStep, g: int, built: StepMask):
        state, spec = self.state, self.state.pool.spec
        dg, s, R = step.groups[g], step.slot, step.padded_batch_size
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        arrays = (step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len)
        import flashinfer  # (imported by the backend module already; here so that check and mask_bytes run without it)

        if step.bucket is None:
            w = state.eager(("tree", s, g), flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            w.plan(*arrays, *heads, spec.page_size, custom_mask=built.data, seq_lens=dg.host_kv_lens, **state.plan_kwargs)
            state.planned_into(s, g, w)
            return w
        mask, mask_indptr = self._buffers(s, g)
        key = ("tree graph", s, g, R, step.q_len)
        w = state.wrappers.get(key)
        if w is None:
            w = state.wrappers[key] = state.share(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                state.float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=step.qo_indptr,
                paged_kv_indptr_buf=dg.kv_indptr, paged_kv_indices_buf=state.pool.index_buffer(step, g),
                paged_kv_last_page_len_buf=dg.kv_last_page_len, custom_mask_buf=mask,
                mask_indptr_buf=mask_indptr[: R + 1]), s, g)
        # a graph-mode wrapper splits KV whenever it may, and its partial outputs grow with the bucket: past
        # the decode wrappers' threshold (requests x KV heads enough to fill the GPU) the split is off, which
        # also keeps them inside the shared float workspace (a constant per key: every replay plans alike)
        fix = R * spec.num_kv_heads >= min(state.fixed_min_ctas, FIXED_MIN_CTAS_FALLBACK)
        w.plan(*arrays, *heads, spec.page_size, packed_custom_mask=built.data, seq_lens=dg.host_kv_lens,
               **({"disable_split_kv": True} if fix else {}), **state.plan_kwargs)
        # plan() wrote bit offsets into the wrapper's mask_indptr (ours): the kernel reads byte offsets
        mask_indptr[: R + 1].copy_(built.seg, non_blocking=True)
        state.planned_into(s, g, w)
        return w

    def _stage_bits(self, step: DeviceStep) -> tuple[np.ndarray, torch.Tensor]:
        """The step's ancestor sets [padded_num_tokens] (a padding request's tokens: a chain): the slot's
        pinned staging (uint64 numpy view; rewritten only once the slot's next commit finds it free) and its
        int64 device copy."""
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

    def _build(self, step: DeviceStep, g: int, kv: np.ndarray, bits: tuple[np.ndarray, torch.Tensor]) -> StepMask:
        """Group g's mask (kv [R]: its lengths, padding included; bits: the ancestor sets on the host and the
        device): packed for a bucketed step, else unpacked; a new device tensor."""
        R, dev = step.padded_batch_size, self.state.pool.device
        q = np.diff(step.host_qo_indptr[: R + 1].numpy())
        packed = step.bucket is not None
        if packed:
            seg = _tree_mask.byte_indptr(q, kv)
        else:
            seg = np.zeros(R + 1, np.int64)
            np.cumsum(q.astype(np.int64) * kv, out=seg[1:])
        a, b = _aligned(R + 1), _aligned(R + 1) + _aligned(R)  # (each array on 16 bytes: one Triton variant for every R)
        lens_host = self.lens_host[step.slot][g][: b + R + 1]
        lens = lens_host.numpy()
        lens[: R + 1], lens[a : a + R], lens[b:] = step.host_qo_indptr[: R + 1].numpy(), kv, seg
        n = int(seg[-1])
        data = torch.empty(n, dtype=torch.uint8 if packed else torch.bool, device=dev)
        if not _tree_mask.available():  # (the host builder: O(total bits) on the host, then one copy)
            data.copy_(torch.from_numpy(_tree_mask.host_mask(q, kv, bits[0], packed)))
        else:
            lens_dev = self.lens_dev[step.slot][g][: b + R + 1]
            lens_dev.copy_(lens_host, non_blocking=True)
            _tree_mask.pack(lens_dev[: R + 1], lens_dev[a : a + R], lens_dev[b:], bits[1], data,
                            int(np.diff(seg).max()), packed)
        return StepMask(data=data, seg=lens_host[b:], kv=kv.copy())

    def _buffers(self, s: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.masks.get((s, g))
        if found is None:
            pool = self.state.pool
            found = self.masks[(s, g)] = (torch.zeros(min(self.mask_bytes(pool), 2**31 - 1), dtype=torch.uint8,
                                                      device=pool.device),
                                          torch.zeros(pool.layout.max_rows + 1, dtype=torch.int32, device=pool.device))
        return found
