"""Attention without a KV cache, for fixed-shape full-attention blocks (encoder, vision tower).

`build_dense_plan` (pure, host numpy) describes B sequences packed into one [total, heads, dim]
tensor; `DenseAttention(plan)` does the host work once (device cu_seqlens, FlashInfer planning)
and its call only launches kernels, so it can be captured in a CUDA graph and replayed for as
long as the object lives. A new shape needs a new plan and a new DenseAttention.

Backends: "reference" (pure torch, any device, float32 math: the oracle), "flash_attn_varlen"
(FA4 with cu_seqlens_q = cu_seqlens_k) and "flashinfer_ragged" (BatchPrefillWithRaggedKVCacheWrapper,
planned from pinned host cu_seqlens). What each serves is the kernels.BACKENDS entry of that name.
"""

from __future__ import annotations

import warnings

import attrs
import numpy as np
import torch

from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES
from mstar_attn.metadata._arrays import array_field
from mstar_attn.metadata.backends import BACKENDS
from mstar_attn.metadata.errors import PlanError

DENSE_BACKENDS = ("reference", "flash_attn_varlen", "flashinfer_ragged")


@attrs.frozen
class DensePlan:
    """B sequences attending within themselves; q, k and v rows cu_seqlens[i]:cu_seqlens[i+1] are sequence i.

    seq_lens [B], cu_seqlens [B+1]: read-only int32 host arrays. causal: query j of a sequence
    sees keys 0..j (q and k have the same length), else every key of its sequence. soft_cap = 0
    disables capping (logits -> cap * tanh(logits / cap)). dtype: of q, k, v and the output.
    """

    seq_lens: np.ndarray = array_field()
    cu_seqlens: np.ndarray = array_field()
    max_seqlen: int
    num_tokens: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    sm_scale: float
    soft_cap: float
    dtype: torch.dtype
    backend: str

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


@attrs.frozen
class DenseHeads:
    """The heads of a dense attention block: num_qo_heads query heads over num_kv_heads key / value heads
    (a multiple of it), head_dim each."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int


def build_dense_plan(seq_lens, *args, **kwargs) -> DensePlan:
    """build_dense_plan(seq_lens, heads, *, causal=False, sm_scale=None, soft_cap=0.0, dtype=torch.bfloat16,
    backend="flash_attn_varlen"): validate and pack sequence lengths [B] for `heads` (DenseHeads). Pure;
    raises PlanError naming the field (and the request). The heads as three numbers, positional
    (seq_lens, num_qo_heads, num_kv_heads, head_dim) or by name (num_qo_heads=..., ...), still work, with a
    DeprecationWarning."""
    old = [kwargs.pop(name) for name in ("num_qo_heads", "num_kv_heads", "head_dim") if name in kwargs]
    if old or (args and not isinstance(args[0], DenseHeads)):
        numbers = [*args[:3], *old]
        if len(numbers) != 3 or "heads" in kwargs:
            raise PlanError(f"heads: expected a DenseHeads(num_qo_heads, num_kv_heads, head_dim), got {args[:3]!r} "
                            f"and {old!r}")
        warnings.warn("build_dense_plan(seq_lens, num_qo_heads, num_kv_heads, head_dim, ...) is deprecated: pass "
                      "DenseHeads(num_qo_heads, num_kv_heads, head_dim)", DeprecationWarning, stacklevel=2)
        args = (DenseHeads(*numbers), *args[3:])
    if len(args) > 1:
        raise PlanError(f"build_dense_plan: unexpected positional arguments after heads: {args[1:]!r}")
    if not args and "heads" not in kwargs:
        raise PlanError("heads: expected a DenseHeads(num_qo_heads, num_kv_heads, head_dim), got none")
    return _build_dense_plan(seq_lens, *args, **kwargs)


def _build_dense_plan(seq_lens, heads: DenseHeads, *, causal: bool = False, sm_scale: float | None = None,
                      soft_cap: float = 0.0, dtype: torch.dtype = torch.bfloat16,
                      backend: str = "flash_attn_varlen") -> DensePlan:
    if not isinstance(heads, DenseHeads):
        raise PlanError(f"heads: expected a DenseHeads(num_qo_heads, num_kv_heads, head_dim), got {heads!r}")
    num_qo_heads, num_kv_heads, head_dim = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise PlanError(f"{name} must be positive, got {value}")
    if num_qo_heads % num_kv_heads:
        raise PlanError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if soft_cap < 0:
        raise PlanError(f"soft_cap must be >= 0 (0 disables it), got {soft_cap}")
    if backend not in DENSE_BACKENDS:
        raise PlanError(f"backend: {backend!r} is not a dense backend (known: {list(DENSE_BACKENDS)})")
    caps = BACKENDS[backend]
    if dtype not in caps.dtypes:
        raise PlanError(f"dtype: backend {backend!r} serves {sorted(map(str, caps.dtypes))}, not {dtype}")
    if caps.head_dims is not None and head_dim not in caps.head_dims:
        raise PlanError(f"head_dim: backend {backend!r} serves head dims {sorted(caps.head_dims)}, not {head_dim}")
    raw = np.asarray(seq_lens)
    if raw.ndim != 1 or raw.shape[0] == 0:
        raise PlanError(f"seq_lens must be a non-empty 1-D list of lengths, got shape {raw.shape}")
    if not np.issubdtype(raw.dtype, np.integer):
        raise PlanError(f"seq_lens must hold integers, got {raw.dtype}")
    if (raw < 1).any():
        i = int(np.flatnonzero(raw < 1)[0])
        raise PlanError(f"seq_lens[{i}]: every sequence needs at least one token, got {raw[i]} (request {i})")
    if raw.sum() >= 2**31:
        raise PlanError(f"seq_lens: {raw.sum()} tokens in all, more than int32 cu_seqlens hold")
    lens = raw.astype(np.int32)
    cu = np.zeros(lens.shape[0] + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    lens.flags.writeable = cu.flags.writeable = False
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    return DensePlan(lens, cu, int(lens.max()), int(cu[-1]), num_qo_heads, num_kv_heads, head_dim, bool(causal), scale,
                     float(soft_cap), dtype, backend)


def reference_attention(plan: DensePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pure torch, per sequence, float32 math (float64 for float64 inputs); returns q.dtype."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = plan.num_qo_heads // plan.num_kv_heads
    out = torch.empty_like(q)
    for i in range(plan.batch_size):
        a, b = int(plan.cu_seqlens[i]), int(plan.cu_seqlens[i + 1])
        ks = k[a:b].to(work).repeat_interleave(rep, dim=1)
        vs = v[a:b].to(work).repeat_interleave(rep, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[a:b].to(work), ks) * plan.sm_scale
        if plan.soft_cap > 0:
            logits = plan.soft_cap * torch.tanh(logits / plan.soft_cap)
        if plan.causal:
            hidden = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
            logits = logits.masked_fill(hidden, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), vs).to(q.dtype)
    return out


class DenseAttention:
    """One DensePlan bound to a device: `attn(q, k, v)` -> [total, qo_heads, head_dim].

    q [plan.num_tokens, qo_heads, head_dim], k and v [plan.num_tokens, kv_heads, head_dim],
    plan.dtype, on `device`. Construction does all host work: cu_seqlens is copied once from a
    pinned host tensor (kept alive here) into a device int32 [B+1] tensor, and FlashInfer's
    wrapper is planned once; calls then launch kernels only (no sync, capture-safe: call once
    eagerly before capturing, FA4 compiles a kernel per new configuration on its first call).
    float_workspace: FlashInfer's float workspace (uint8 on device), shareable between
    instances that never run concurrently; allocated (FLOAT_WORKSPACE_BYTES, as a pool's) when not given.
    """

    def __init__(self, plan: DensePlan, device: torch.device | str = "cuda", float_workspace: torch.Tensor | None = None):
        self.plan = plan
        self.device = torch.device(device)
        self.fa = self.wrapper = None
        pin = self.device.type == "cuda"
        self.host_cu_seqlens = torch.tensor(plan.cu_seqlens, dtype=torch.int32).pin_memory() if pin else torch.tensor(plan.cu_seqlens)
        self.cu_seqlens = self.host_cu_seqlens.to(self.device, non_blocking=True)
        if plan.backend == "flash_attn_varlen":
            from mstar_attn.kernels.flash_attn import _varlen_func

            self.fa = _varlen_func()
        elif plan.backend == "flashinfer_ragged":
            import flashinfer

            ws = float_workspace if float_workspace is not None else torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
            self.wrapper.plan(self.host_cu_seqlens, self.host_cu_seqlens, plan.num_qo_heads, plan.num_kv_heads,
                              plan.head_dim, causal=plan.causal, logits_soft_cap=plan.soft_cap or None,
                              sm_scale=plan.sm_scale, q_data_type=plan.dtype, kv_data_type=plan.dtype, non_blocking=True)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if q.shape[0] != plan.num_tokens or k.shape[0] != plan.num_tokens or v.shape[0] != plan.num_tokens:
            raise PlanError(f"DenseAttention: q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]} rows; "
                            f"the plan packs {plan.num_tokens}")
        if plan.backend == "reference":
            return reference_attention(plan, q, k, v)
        if plan.backend == "flashinfer_ragged":
            return self.wrapper.run(q, k, v)
        return self.fa(q, k, v, cu_seqlens_q=self.cu_seqlens, cu_seqlens_k=self.cu_seqlens, max_seqlen_q=plan.max_seqlen,
                       max_seqlen_k=plan.max_seqlen, softmax_scale=plan.sm_scale, causal=plan.causal,
                       softcap=plan.soft_cap, num_splits=1)[0]
