"""FlashInfer's token-tree verify steps (plan.tree): the cached prefix and the tree, merged.

Token j of request r attends to the request's cached prefix (its first p_r = kv_r - q_r keys) and to its
ancestors and itself among the step's q_r new tokens (metadata/tree.py). Each layer runs that as two
attentions merged by their log-sum-exp (FlashInfer's, base 2), as a shared-prefix step merges its levels:

    o1, lse1 = prefix.run(q)             paged prefill over each request's prefix, no mask
    o2, lse2 = tree.run(q, k_t, v_t)     ragged prefill over the request's own new tokens, the ancestor mask
    o1, lse1 = merge(o1, lse1, o2, lse2)

so the long part reads no mask, at the speed of the chain's verify, and the mask covers q_r x q_r bits per
request, not q_r x kv_r. k_t, v_t [padded tokens, kv_heads, head_dim]: the new tokens' K/V read back from the
cache by the step's slots, as stored (an FP8 cache's bytes, scaled by the kernel as the prefix's are). The
tree part (gather, ragged prefill) runs on the pool's side stream beside the prefix, forked from the caller's
stream after everything the step depends on and joined before the merge (inside a captured graph: two
parallel branches); its buffers are made on the caller's stream before the fork, so the join orders their
reuse. It plans into an int workspace of its own (both plans are live at once) and a float workspace of its
own: splitting no KV it keeps nothing there, and a kernel that did would fail FlashInfer's size check, never
race the prefix's partial outputs in the shared one.

- The prefix reads the step's own page lists (`prefix_requests`): 2R requests to FlashInfer, request r's
  prefix (its first ceil(p_r / page_size) pages, its queries) then one of no queries over its remaining pages
  (those only the tree's tokens fill). That is a CSR over the same page indices, with every length, page count
  and split-KV chunk FlashInfer derives being the prefix's (a prefix's pages listed with the tree's after them
  would give its planner chunks past the prefix: wrong outputs). A request of no prefix gets output 0 and
  lse -inf, which the merge weighs 0.
- The mask: request r's q_r x q_r bit matrix (row-major, little-endian) packed from byte offset sum_{i<r}
  q_i^2, its bit count so far. FlashInfer's planner computes mask offsets as those bit counts and its kernel
  reads them as byte offsets: in this layout (q_r^2 bytes a request, 8x what packing needs, at most 4 KiB)
  both agree with no fix-up. Built at commit on the device by one Triton launch (kernels/_tree_mask.py,
  the prefix taken as empty) from the ancestor sets staged with the step (8 bytes a token); where Triton does
  not run, on the host. One mask per step: it depends on the trees alone, so every layer group shares it.
- A bucketed step (one tree size, at most the pool's max_verify_q_len (PoolLimits.max_tree_nodes), the batch padded: a padding request's tokens a
  chain over the scratch page, with no prefix) plans graph-mode wrappers per (slot, group, bucket, size)
  over the slot's buffers and this module's: the prefix's last-page lengths, the mask and its offsets; many
  requests plan the prefix with split-KV off, as decode buckets do (its partial outputs then stay within the
  shared float workspace). Any other tree step plans eager wrappers per slot (and group).

Buffers and staging are made at the pool's first tree step: capture tree graphs on the serving pool
(DecodeGraphs.capture(trees=True)) before serving, so that no allocation falls inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from mstar_attn.kernels import _tree_mask
from mstar_attn.kernels._common import with_sinks
from mstar_attn.kernels._flashinfer_fast import graph_workspace_bytes, share_workspace
from mstar_attn.metadata.tree import MAX_TREE_NODES

if TYPE_CHECKING:
    from mstar_attn.capture.step import DeviceStep

TAIL = 16  # bytes of slack past a mask
TREE_FLOAT_BYTES = 1 << 20  # the tree part's float workspace (it splits no KV: FlashInfer keeps nothing there)
FIXED_MIN_CTAS_FALLBACK = 264  # requests x KV heads past which bucketed prefixes never split KV (2 CTAs per SM
# of an H100) when the backend's own fixed schedule is off
@attrs.frozen
class PrefixRequests:
    """The prefix pass's requests (see prefix_requests), host int32: qo_indptr [2R+1], kv_indptr [2R+1],
    last_page_len [2R], kv_lens [2R]."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    kv_lens: np.ndarray


def prefix_requests(qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray, page_size: int) -> PrefixRequests:
    """A tree step's R requests (qo_indptr [R+1] rows, kv_indptr [R+1] pages, kv_lens [R] keys, each request's
    new tokens last) as the prefix pass's 2R: request 2r the prefix of r (its keys but the q_r new ones, its
    first pages, its queries), request 2r + 1 no queries over r's pages after those. Pure."""
    qo, ind = qo_indptr.astype(np.int64), kv_indptr.astype(np.int64)
    p = kv_lens.astype(np.int64) - np.diff(qo)
    pages = -(-p // page_size)
    R = p.shape[0]
    out = PrefixRequests(qo_indptr=np.zeros(2 * R + 1, np.int32), kv_indptr=np.zeros(2 * R + 1, np.int32),
                         last_page_len=np.zeros(2 * R, np.int32), kv_lens=np.zeros(2 * R, np.int32))
    out.qo_indptr[0::2], out.qo_indptr[1::2] = qo, qo[1:]
    out.kv_indptr[0::2], out.kv_indptr[1::2] = ind, ind[:-1] + pages
    out.last_page_len[0::2] = np.where(pages > 0, p - (pages - 1) * page_size, 0)
    out.last_page_len[1::2] = page_size
    out.kv_lens[0::2], out.kv_lens[1::2] = p, (ind[1:] - ind[:-1] - pages) * page_size
    return out


def split_fits(spec, requests: int, tokens: int, sms: int, float_bytes: int) -> bool:
    """Whether a graph-mode prefix pass of `requests` requests and `tokens` query rows (2 x requests to FlashInfer,
    prefix_requests) may split KV within a float workspace of float_bytes: FlashInfer's planner keeps
    num_qo_heads x ceil(padded CTAs x cta_tile_q / gqa) partial rows of head_dim + 1 floats, its padded CTAs
    at most max(2 per SM / kv_heads, tokens x gqa / cta_tile_q + 2 x requests - 1) (scheduler.cuh); bounded
    here over cta_tile_q <= 128."""
    gqa = spec.gqa_group
    rows = -(-max(2 * sms // spec.num_kv_heads * 128, tokens * gqa + 256 * requests) // gqa)
    return spec.num_qo_heads * rows * (spec.head_dim + 1) * 4 + 4096 <= float_bytes


def mask_offsets(q_lens: np.ndarray) -> np.ndarray:
    """[R+1] int64: where request r's mask starts (bytes), sum_{i<r} q_i^2 (see the module's docstring)."""
    out = np.zeros(q_lens.shape[0] + 1, np.int64)
    np.cumsum(q_lens.astype(np.int64) ** 2, out=out[1:])
    return out


@attrs.frozen
class TreeRun:
    """What `run` needs of one layer group's tree step: the planned prefix and tree wrappers, the step's
    slots (the group's slot_mapping, int64 device) and the side stream the tree part runs on."""

    prefix: object
    tree: object
    slots: torch.Tensor
    side: torch.cuda.Stream


def _aligned(n: int) -> int:
    """n int32 entries rounded up to 16 bytes."""
    return -(-n // 4) * 4


class TreeState:
    """Tree steps' buffers of one pool's FlashInfer PoolState (`state`). Per slot: the ancestor sets, pinned
    [max tokens] int64 and on the device; the mask kernel's arrays (qo_indptr, q_lens, mask offsets) int32
    [3 x max batch + 12] pinned and on the device; the tree part's int workspace (graph_workspace_bytes, never split) and its
    pinned mirror; made at its first bucketed step, the mask buffer uint8 [max batch x max_verify_q_len^2 +
    TAIL] and its offsets int32 [max batch + 1]. Per (slot, group): the prefix pass's arrays (PrefixRequests of
    2 x max batch requests), int32 pinned, and three of them on the device (graph-mode prefixes read them)."""

    def __init__(self, state):
        self.state, pool = state, state.pool
        n, B, G, S, dev = pool.layout.max_tokens, pool.layout.max_rows, len(pool.spec.groups), pool.num_slots, pool.device
        self.bits_host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(S)]
        self.bits_dev = [torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(S)]
        self.lens_host = [torch.zeros(3 * B + 12, dtype=torch.int32, pin_memory=True) for _ in range(S)]
        self.lens_dev = [torch.zeros(3 * B + 12, dtype=torch.int32, device=dev) for _ in range(S)]
        # the prefix pass's arrays (PrefixRequests, 2B requests) per (slot, group): pinned, and on the device
        # for graph-mode prefixes (qo_indptr, kv_indptr, last_page_len; their plan() copies them there)
        self.prefix_host = [[torch.zeros(4 * _aligned(2 * B + 1), dtype=torch.int32, pin_memory=True) for _ in range(G)]
                            for _ in range(S)]
        self.prefix_dev = [[torch.zeros(3 * _aligned(2 * B + 1), dtype=torch.int32, device=dev) for _ in range(G)]
                           for _ in range(S)]
        spec = pool.spec  # (the tree part plans without split-KV)
        m = graph_workspace_bytes(B, MAX_TREE_NODES, spec.gqa_group, spec.num_kv_heads, state.sms, split=False)
        self.side = torch.cuda.Stream(dev)
        self.float_ws = torch.zeros(TREE_FLOAT_BYTES, dtype=torch.uint8, device=dev)  # (the side stream's: see above)
        self.int_ws = [torch.zeros(m, dtype=torch.uint8, device=dev) for _ in range(S)]
        self.pinned_ws = [torch.zeros(m, dtype=torch.uint8, pin_memory=True) for _ in range(S)]
        self.masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (mask buffer, its offsets)
        self.wrappers: dict[tuple, object] = {}  # the tree part's: ("eager", slot) or ("graph", slot, R, q_len)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this state owns."""
        return [*self.bits_host, *self.bits_dev, *self.lens_host, *self.lens_dev, *self.int_ws, self.float_ws,
                *self.pinned_ws, *(t for per in (*self.prefix_host, *self.prefix_dev) for t in per),
                *(t for pair in self.masks.values() for t in pair)]

    def memory(self) -> dict[str, tuple[int, int]]:
        """(device bytes, pinned bytes) of the masks, workspaces and staging."""
        ts = self.tensors()
        return {"flashinfer tree masks, workspaces and staging": (
            sum(t.numel() * t.element_size() for t in ts if t.is_cuda),
            sum(t.numel() * t.element_size() for t in ts if not t.is_cuda))}

    def schedule(self, step: DeviceStep) -> tuple:
        """One TreeRun per layer group for tree step `step`: the tree part planned once (its mask built once),
        each group's prefix planned over its own page lists."""
        self.state.pool.stage_host(step)  # (a StepRows step's pinned arrays, staged only when a planner reads them)
        R = step.padded_batch_size
        q = np.diff(step.host_qo_indptr[: R + 1].numpy())
        tree = self._plan_tree(step, q, self._build_mask(step, q))
        return tuple(TreeRun(prefix=self._plan_prefix(step, g), tree=tree, slots=dg.slot_mapping, side=self.side)
                     for g, dg in enumerate(step.groups))

    def _plan_prefix(self, step: DeviceStep, g: int):
        """Group g's prefix wrapper, planned over the step's page lists as prefix_requests lays them out."""
        import flashinfer  # (imported by the backend module already)

        state, spec = self.state, self.state.pool.spec
        dg, s, R = step.groups[g], step.slot, step.padded_batch_size
        pr = prefix_requests(step.host_qo_indptr[: R + 1].numpy(), dg.host_kv_indptr[: R + 1].numpy(),
                             dg.host_kv_lens[:R].numpy(), spec.page_size)
        a, n = _aligned(2 * R + 1), 2 * R + 1
        host = self.prefix_host[s][g]
        qo, ptr, last, lens = host[:n], host[a : a + n], host[2 * a : 2 * a + n - 1], host[3 * a : 3 * a + n - 1]
        for t, x in ((qo, pr.qo_indptr), (ptr, pr.kv_indptr), (last, pr.last_page_len), (lens, pr.kv_lens)):
            t.numpy()[:] = x
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        if step.bucket is None:
            w = state.eager(("tree prefix", s, g), flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            w.plan(qo, ptr, dg.kv_indices, last, *heads, spec.page_size, causal=False, seq_lens=lens,
                   **state.plan_kwargs)
            return w
        key = ("tree prefix graph", s, g, R, step.q_len)
        w = state.wrappers.get(key)
        if w is None:  # (FA2: the kernels the chain's verify runs, with split-KV; the device reads these buffers)
            d = self.prefix_dev[s][g]
            w = state.wrappers[key] = state.share(flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                state.float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=d[:n], paged_kv_indptr_buf=d[a : a + n],
                paged_kv_indices_buf=state.pool.index_buffer(step, g), paged_kv_last_page_len_buf=d[2 * a : 2 * a + n - 1],
                backend="fa2"), s, g)
        # a graph-mode wrapper splits KV whenever it may, and its partial outputs grow with the bucket: past
        # the decode wrappers' threshold (requests x KV heads enough to fill the GPU) the split is off, which
        # also keeps them inside the shared float workspace (a constant per key: every replay plans alike)
        # (and where its partial outputs might outgrow the float workspace: FlashInfer would refuse the plan)
        fix = R * spec.num_kv_heads >= min(state.fixed_min_ctas, FIXED_MIN_CTAS_FALLBACK) or not split_fits(
            spec, R, step.padded_num_tokens, state.sms, state.float_ws.numel())
        w.plan(qo, ptr, dg.listed(), last, *heads, spec.page_size, causal=False, seq_lens=lens,  # (the ids in use: the
               **({"disable_split_kv": True} if fix else {}), **state.plan_kwargs)  # wrapper copies them onto themselves)
        return w

    def _plan_tree(self, step: DeviceStep, q: np.ndarray, mask: torch.Tensor):
        """The tree part's ragged wrapper (the slot's workspaces), planned with the step's mask."""
        import flashinfer

        state, spec, s, R = self.state, self.state.pool.spec, step.slot, step.padded_batch_size
        key = ("eager", s) if step.bucket is None else ("graph", s, R, step.q_len)
        w = self.wrappers.get(key)
        if w is None:
            if step.bucket is None:
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.float_ws, "NHD", backend="fa2")
            else:
                buf, offsets = self._buffers(s)
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    self.float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=step.qo_indptr,
                    kv_indptr_buf=step.qo_indptr, custom_mask_buf=buf, mask_indptr_buf=offsets[: R + 1], backend="fa2")
            share_workspace(w, self.float_ws, self.int_ws[s], self.pinned_ws[s])
            self.wrappers[key] = w
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        w.plan(step.host_qo_indptr, step.host_qo_indptr, *heads, packed_custom_mask=mask, disable_split_kv=True,
               **state.plan_kwargs)  # (K/V read back from the cache: its dtype)
        return w

    def _build_mask(self, step: DeviceStep, q: np.ndarray) -> torch.Tensor:
        """The step's mask (uint8 [sum q^2], a new device tensor): the ancestor sets staged (a padding request's
        tokens: a chain) and copied, then packed on the device (or built on the host and copied)."""
        plan, s, R = step.plan, step.slot, step.padded_batch_size
        T, N = plan.num_tokens, step.padded_num_tokens
        bits = self.bits_host[s].numpy()
        bits[:T] = plan.tree.masks.view(np.int64)
        if N > T:
            pad = (np.uint64(2) << np.arange(step.q_len, dtype=np.uint64)) - np.uint64(1)  # token j: tokens 0..j
            bits[T:N] = np.tile(pad.view(np.int64), (N - T) // step.q_len)
        seg = mask_offsets(q)
        out = torch.empty(int(seg[-1]), dtype=torch.uint8, device=self.state.pool.device)
        if not _tree_mask.available():  # (the host builder, then one copy)
            out.copy_(torch.from_numpy(_tree_mask.host_mask(q, q, bits[:N].view(np.uint64), offsets=seg)))
            return out
        a, b = _aligned(R + 1), _aligned(R + 1) + _aligned(R)  # (each array on 16 bytes: one Triton variant for every R)
        lens = self.lens_host[s].numpy()
        lens[: R + 1], lens[a : a + R], lens[b : b + R + 1] = step.host_qo_indptr[: R + 1].numpy(), q, seg
        dev, bits_dev = self.lens_dev[s][: b + R + 1], self.bits_dev[s][:N]
        dev.copy_(self.lens_host[s][: b + R + 1], non_blocking=True)
        bits_dev.copy_(self.bits_host[s][:N], non_blocking=True)
        return _tree_mask.pack(dev[: R + 1], dev[a : a + R], dev[b:], bits_dev, out, int((q.astype(np.int64) ** 2).max()))

    def _buffers(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.masks.get(s)
        if found is None:
            pool = self.state.pool
            B = pool.layout.max_rows
            found = self.masks[s] = (torch.zeros(B * pool.max_verify_q_len**2 + TAIL, dtype=torch.uint8, device=pool.device),
                                     torch.zeros(B + 1, dtype=torch.int32, device=pool.device))
        return found


def run(step: DeviceStep, q: torch.Tensor, cache, t: TreeRun, sinks: torch.Tensor | None = None,
        scales: dict | None = None) -> torch.Tensor:
    """One layer of a tree step: q [rows, qo_heads, head_dim] (a bucketed step's padding rows included, or
    not), spec.dtype, on the cache's device; returns the same shape. sinks (float32 [qo_heads]): applied once,
    by the merged log-sum-exp; scales: an FP8 cache's k_scale / v_scale (host floats)."""
    import flashinfer

    rows, N = q.shape[0], step.padded_num_tokens
    if rows < N:  # an eager call on a bucket-padded step: padding requests read the scratch page
        q = torch.cat([q, q[:1].expand(N - rows, -1, -1)])
    scales = scales or {}
    k_t, v_t = cache.k.new_empty((N, *cache.k.shape[2:])), cache.v.new_empty((N, *cache.v.shape[2:]))
    o2 = torch.empty_like(q)  # (all made on the caller's stream before the fork: the join orders their reuse)
    lse2 = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    main = torch.cuda.current_stream(q.device)
    t.side.wait_stream(main)  # (the fork: q, the cache and the step's slots as the caller's stream left them)
    # the prefix first: run eagerly, the device starts the long part while the host issues the rest
    o1, lse1 = t.prefix.run(q, (cache.k, cache.v), return_lse=True, **scales)
    try:
        with torch.cuda.stream(t.side):
            for src, dst in ((cache.k, k_t), (cache.v, v_t)):
                flat = src.flatten(0, 1)
                if flat.element_size() == 1:  # (an FP8 cache: its bytes, as stored; the kernel applies the scales)
                    flat, dst = flat.view(torch.uint8), dst.view(torch.uint8)
                torch.index_select(flat, 0, t.slots[:N], out=dst)
            t.tree.run(q, k_t, v_t, out=o2, lse=lse2, return_lse=True, **scales)
    finally:  # (the join, also when the tree part raised: a capture then reports that error, not an unjoined stream)
        main.wait_stream(t.side)
    flashinfer.merge_state_in_place(o1, lse1, o2, lse2)
    return with_sinks(o1, lse1, sinks, lse_base2=True, fused=True)[:rows]
