"""Re-planning FlashInfer graph-mode decode wrappers without plan()'s Python overhead, and
sharing one int workspace (and its pinned mirror) between wrappers.

The one place mstar_attn reaches into FlashInfer internals, pinned to the versions in VERSIONS
(elsewhere every wrapper is planned through its public plan()). A graph-mode wrapper's shapes and
options are frozen after its first plan(), which goes through the public API: it resolves the
backend, loads the JIT module, and records the dtypes, window, scale and soft-cap run() reads.
Each later plan only has to refresh the split-KV schedule, so `FastDecodePlan` calls the module's
C++ planner directly with the pool's pinned host arrays. What public plan() does on top is
redundant here: copying indptr / last_page_len / indices into buffers that *are* the pool
slot's device arrays (commit's one copy already filled them), re-deriving kv lengths, and
resolving the backend and module again (about 100 µs of host time per call on an H100 host).

`share_workspace` points a wrapper at workspaces the pool owns. FlashInfer's public
reset_workspace_buffer() takes the float and int workspaces but always allocates a fresh 8 MiB
pinned mirror of the int one; the wrappers one pool slot and layer group plans at every commit share
one int workspace (one step per slot at a time, and a slot is replanned only once its last copies
ran), so they share one mirror too. A graph-mode decode wrapper keeps its plan across commits, so it
gets an int workspace of its own, sized by `graph_workspace_bytes` from the planners' layout (below).

tests/kernels/test_flashinfer.py::test_fast_replan_matches_public_plan compares this path with
public plan() (plan info, the int workspace it writes, and the attention output), and
test_wrappers_share_the_slot_workspaces checks the sharing; both fail loudly when these
internals move.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn.metadata._arrays import Ranges

VERSIONS = ("0.7.2", "0.7.2.post1")  # the FlashInfer releases whose internals this module reads
FIXED_WORKSPACE_BYTES = 64 << 10  # the least int workspace a graph-mode wrapper gets (graph_workspace_bytes)
MAX_CTAS_PER_SM = 32  # the most thread blocks an SM holds (sm_80 to sm_100): a bound on a split-KV grid per SM


def graph_workspace_bytes(rows: int, q_len: int, gqa: int, num_kv_heads: int, num_sms: int, split: bool = True) -> int:
    """The int workspace of a graph-mode wrapper's plans at `rows` padded requests of q_len tokens: split-KV or not,
    or with `split` False never split (disable_split_kv on a planner that honours it). Both planners (CUDA-core
    decode: DecodePlan; tensor cores, ragged prefill: PrefillPlan) lay out at most three int32 work lists and a
    byte mask over padded_batch_size CTAs, o_indptr (and, split, merge_indptr: at most max(CTAs, rows * q_len) + 1
    int32 each; unsplit, o_indptr [rows + 1] alone) and two words, each 16-byte aligned. Under CUDA graphs
    padded_batch_size is at most the larger of the grid per KV head (blocks per SM x SMs / num_kv_heads: at most
    MAX_CTAS_PER_SM blocks per SM split; the tensor-core planner's 2 also unsplit) and the unsplit tiles (at most
    rows * (q_len * gqa + 1)), whatever the lengths: the same for every plan of the wrapper. Twice that, in 4 KiB
    pages, at least 64 KiB. (Too small would make FlashInfer's planner raise, never write past it.)"""
    ctas = max(rows * (q_len * gqa + 1), (MAX_CTAS_PER_SM if split else 2) * num_sms // num_kv_heads)
    need = 13 * ctas + (8 * (max(ctas, rows * q_len) + 1) if split else 4 * (rows + 1)) + 8 + 7 * 16
    return max(FIXED_WORKSPACE_BYTES, -(-2 * need // 4096) * 4096)


def supported(flashinfer_module) -> bool:
    """Whether the installed FlashInfer is one this module was written against (else: public plan())."""
    return flashinfer_module.__version__ in VERSIONS


def share_workspace(wrapper, float_ws: torch.Tensor, int_ws: torch.Tensor, pinned_int_ws: torch.Tensor) -> None:
    """Make `wrapper` (any FlashInfer attention wrapper) plan into int_ws through pinned_int_ws and run
    with float_ws. int_ws: uint8 device; pinned_int_ws: uint8 pinned CPU of the same size."""
    if not isinstance(getattr(wrapper, "_pin_memory_int_workspace_buffer", None), torch.Tensor):
        raise RuntimeError(f"share_workspace: {type(wrapper).__name__} has no _pin_memory_int_workspace_buffer; "
                           "FlashInfer's internals moved (see _flashinfer_fast.VERSIONS)")
    if pinned_int_ws.shape != int_ws.shape or not pinned_int_ws.is_pinned():
        raise ValueError("share_workspace: the pinned mirror must be pinned and as large as the int workspace")
    wrapper.reset_workspace_buffer(float_ws, int_ws)  # public; allocates a fresh mirror, replaced below
    wrapper._pin_memory_int_workspace_buffer = pinned_int_ws


def split_kv(wrapper) -> bool:
    """Whether the wrapper's last plan splits requests' KV into chunks (merged afterwards). The plan
    info the C++ planners return ends with split_kv: DecodePlanInfo (10 entries, CUDA-core decode)
    and PrefillPlanInfo (15, the tensor-core path). A plan without split is a function of the batch
    size (and q_len) alone; the kernels read each request's length at run time."""
    info = getattr(wrapper, "_plan_info", None)
    try:
        n, last = len(info), int(info[-1])
    except (TypeError, ValueError, IndexError):
        n, last = -1, -1
    if n not in (10, 15) or last not in (0, 1):
        raise RuntimeError(f"split_kv: {type(wrapper).__name__}._plan_info is not the plan info this module reads "
                           "(see VERSIONS)")
    return bool(last)


def padded_batch(wrapper) -> int:
    """The CTAs the wrapper's last plan launches (padded_batch_size, index 0 of DecodePlanInfo and PrefillPlanInfo):
    what graph_workspace_bytes bounds (tests/kernels/test_flashinfer.py holds every plan to it)."""
    split_kv(wrapper)  # (raises unless _plan_info is a plan info this module reads)
    return int(wrapper._plan_info[0])


class FastDecodePlan:
    """The frozen planner call of one graph-mode BatchDecodeWithPagedKVCacheWrapper.

    Build it right after the wrapper's first public plan(), with the pool's AttentionSpec (heads,
    head_dim, page_size, soft_cap, dtype, kv_cache_dtype are read), the layer group's window_left and
    the step's q_len and its padded batch size `rows` (the wrapper's bucket); then `replan(qo_indptr, kv_indptr,
    kv_lens)` with pinned CPU int32 tensors ([rows+1], [rows+1], [rows]) re-plans the wrapper for a new step of the
    same bucket. kv_lens are only read by the tensor-core planner.
    """

    def __init__(self, wrapper, spec, window_left: int, q_len: int, rows: int):
        w = wrapper
        num_qo_heads, num_kv_heads, head_dim, page_size = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
        soft_cap, dtype, kv_dtype = float(spec.soft_cap), spec.dtype, spec.kv_cache_dtype
        backend = getattr(w, "_backend", None)
        if not w.is_cuda_graph_enabled or getattr(w, "_jit_module", True) is not None or w._uses_cudnn \
                or getattr(w, "_plan_info", None) is None or backend not in ("fa2", "fa3", "auto"):
            raise RuntimeError("FastDecodePlan: FlashInfer's decode wrapper internals are not the ones this module "
                               f"reads (backend={backend!r}); use the public plan()")
        self.wrapper, self.module, self.q_len, self.rows = w, w._cached_module, q_len, rows
        self.tensor_cores = w.use_tensor_cores
        self.head = (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
        self.mirror = self.head[2].numpy()  # (the pinned mirror as host bytes: remember reads it per plan)
        self.page_size, self.window_left = page_size, window_left
        self.chunks: ChunkRanges | None = None
        self.remember()
        if self.tensor_cores:  # the prefill planner, as _plan_impl calls it
            self.tail = (num_qo_heads, num_kv_heads, page_size, True, head_dim, head_dim, q_len > 1, window_left)
            if backend == "fa2":  # fixed_split_size, disable_split_kv, num_colocated_ctas, uniform_q_len
                self.tail += (-1, False, 0, q_len if q_len > 1 else 0)
        else:  # the CUDA-core decode planner
            device = w._float_workspace_buffer.device
            self.tail = (num_qo_heads, num_kv_heads, page_size, True, window_left, soft_cap, head_dim, head_dim,
                         torch.empty(0, dtype=dtype, device=device), torch.empty(0, dtype=kv_dtype or dtype, device=device))

    def replan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_lens: torch.Tensor) -> None:
        rows = kv_lens.shape[0]
        if self.chunks is not None:  # (the wrapper's plan changes now: no step holds until `plans` records it)
            self.chunks.forget()
        if self.tensor_cores:
            info = self.module.plan(*self.head, qo_indptr, kv_indptr, kv_lens, rows * self.q_len, rows, *self.tail)
        else:
            info = self.module.plan(*self.head, kv_indptr, rows, *self.tail)
        self.wrapper._plan_info = info
        self.remember()

    def remember(self) -> None:
        """Read the chunk size of the wrapper's plan from the pinned int workspace the planner wrote:
        the kv_chunk_size_ptr entry of DecodePlanInfo (index 7) / PrefillPlanInfo (index 9), int32
        tokens; the tensor-core planner also caps a windowed request's pages at
        ceil((window_left + cta_tile_q) / page_size) (cta_tile_q: PrefillPlanInfo index 3)."""
        info = self.wrapper._plan_info
        at = int(info[9] if self.tensor_cores else info[7])
        tokens = int(self.mirror[at : at + 4].view(np.int32)[0])  # (pinned host memory: no sync)
        wl = self.window_left
        cap = -(-(wl + int(info[3])) // self.page_size) if self.tensor_cores and wl >= 0 else None
        chunk_pages = max(tokens // self.page_size, 1)
        chunks = self.chunks
        if chunks is None or chunks.chunk_pages != chunk_pages or chunks.cap != cap:  # (else the same rule: kept)
            self.chunks = ChunkRanges(chunk_pages, self.page_size, cap, self.rows, self.q_len)

    def plans(self, kv_lens: np.ndarray) -> None:
        """Record the step just planned: its B requests' KV lengths [B] int32 (the group's kv_lens; the
        rows - B padding requests' are q_len each)."""
        self.chunks.plan(kv_lens)

    def holds(self, kv_lens: np.ndarray) -> bool:
        """Whether the current plan serves a step of this bucket whose B requests have these KV lengths [B]
        (int32 host) without planning again."""
        return self.chunks.holds(kv_lens)


class ChunkRanges:
    """When a FlashInfer decode plan still holds. Its planners split request i's KV into
    c_i = ceil(max(min(pages_i, cap), 1) / chunk_pages) chunks (pages_i = ceil(kv_len_i / page_size),
    cap: the tensor-core planner's window cap, else None), over the plan's `rows` requests: the bucket's, the
    padding requests' included (KV length `pad_len` each: the step's q_len). The work lists, merge offsets and
    padded grid depend on the counts alone, and the kernels read each request's length from the device and
    clip its last chunk to it, so a plan made for other lengths serves a step iff every c_i is the
    same: iff each kv_len_i lies in ((c_i - 1) * T, c_i * T] with T = chunk_pages * page_size tokens
    (unbounded above at the capped count). A step of fewer requests in the same bucket leaves the rest padding:
    it holds too where those requests' counts were a padding request's (its order or its batch size may change:
    an encoder-decoder's or a batch whose requests come and go). `holds` checks that (metadata/_arrays.Ranges).
    Pure numpy (tests/kernels/test_flashinfer_chunks.py)."""

    def __init__(self, chunk_pages: int, page_size: int, cap: int | None, rows: int, pad_len: int):
        self.chunk_pages, self.page_size, self.cap = chunk_pages, page_size, cap
        self.rows, self.pad_len = rows, pad_len
        self.tokens = chunk_pages * page_size
        self.pad_count = int(self.counts(np.array([pad_len]))[0])  # a padding request's count
        self.ranges: Ranges | None = None  # per request of the rows: the kv_lens of its count (from the last plan)
        self._pad_from: list[bool] = []  # [rows + 1]: whether every request from i on counts as a padding request
        self._over: dict[int, Ranges] = {}  # B -> the ranges of the first B requests (made on first use)

    def counts(self, kv_lens: np.ndarray) -> np.ndarray:
        """c_i [B] for these lengths, as FlashInfer's planners count them."""
        pages = (kv_lens.astype(np.int64) + self.page_size - 1) // self.page_size
        if self.cap is not None:
            pages = np.minimum(pages, self.cap)
        return (np.maximum(pages, 1) + self.chunk_pages - 1) // self.chunk_pages

    def plan(self, kv_lens: np.ndarray) -> None:
        """Record the plan just made for a step whose B requests (1 <= B <= rows) have these KV lengths [B] (int32
        host), the rest of the rows padding requests."""
        B = kv_lens.shape[0]
        if not 1 <= B <= self.rows:
            self.forget()
            raise ValueError(f"ChunkRanges.plan: {B} requests in a plan of {self.rows}")
        lanes = np.full(self.rows, self.pad_len, np.int64)
        lanes[:B] = kv_lens
        c = self.counts(lanes)
        low = ((c - 1) * self.tokens + 1).astype(np.int32)  # the least kv_len of each count
        span = np.full(c.shape, self.tokens, np.int64)
        if self.cap is not None:  # the capped count holds for any longer length (up to int32's)
            top = c == -(-self.cap // self.chunk_pages)
            span[top] = 2**31 - low[top].astype(np.int64)
        self.ranges = Ranges(low, span.astype(np.uint32))
        pad = c == self.pad_count
        # [rows + 1]: whether every request from i on counts as a padding request (a suffix AND, then True past the end)
        self._pad_from = np.logical_and.accumulate(pad[::-1])[::-1].tolist() + [True]
        self._over = {self.rows: self.ranges}

    def forget(self) -> None:
        """No plan recorded: nothing holds until the next `plan`."""
        self.ranges, self._pad_from, self._over = None, [], {}

    def over(self, B: int) -> Ranges | None:
        """The kv_lens [B] (int32 host) of a step of B requests that the plan serves, as Ranges over them (int32 low,
        uint32 span); None when it serves no such step (nothing planned, B outside 1..rows, or a request past the
        B-th counts otherwise than a padding request)."""
        if self.ranges is None or not 1 <= B <= self.rows or not self._pad_from[B]:
            return None
        r = self._over.get(B)
        if r is None:
            r = self._over[B] = Ranges(self.ranges.low[:B], self.ranges.span[:B])
        return r

    def holds(self, kv_lens: np.ndarray) -> bool:
        """Whether the recorded plan serves a step whose B requests have these KV lengths [B] (int32 host)."""
        r = self.over(kv_lens.shape[0])
        return r is not None and r.holds(kv_lens)
