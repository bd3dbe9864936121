"""FlashInfer's XQA FP8 decode kernel (AttentionSpec.fp8_math, Hopper): the pool's state for it and its
run; the FlashInfer backend's decode steps of an fp8_math spec run here (kernels/flashinfer.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.kernels._tables import BlockTables
from mstar_attn.metadata.errors import PlanError

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView
    from mstar_attn.capture.step import DeviceStep


class Xqa:
    """The pool's state for FlashInfer's XQA FP8 decode kernel (AttentionSpec.fp8_math), Hopper only.

    XQA has no host planner: its grid is fixed by the batch rows, the KV heads and the page table's
    width (bucketed steps: max_pages_per_request), and it reads every request's length from the
    device at run time, so a captured graph replays any later commit. It reads dense page tables
    (BlockTables) and a uint32 view of the group's kv_lens. Its multi-block mode splits each
    sequence over at most ~0.75 x SMs / (rows x KV heads) CTAs, which meet through semaphores (zero
    at rest: the last CTA of a sequence resets its counter) and a float scratch of their partial
    outputs. One of each for the pool: kernels of one stream never overlap (like the float workspace).
    Memory: semaphores 4 * max_rows * kv_heads bytes, scratch (0.75 * SMs + 2 * max_rows * kv_heads)
    chunks of gqa * (8 + 2 * head_dim) bytes, doubled for alignment, plus the page tables.
    """

    def __init__(self, pool: PoolView):
        from flashinfer.xqa import get_xqa_module

        if torch.cuda.get_device_capability(pool.device)[0] != 9:
            raise PlanError("spec.fp8_math: FlashInfer's XQA FP8 decode kernel (mha_sm90) runs on Hopper (SM90) only")
        spec = pool.spec
        self.tables = BlockTables(pool, [g for g, grp in enumerate(spec.groups) if not grp.cross])
        self.sm_count = torch.cuda.get_device_properties(pool.device).multi_processor_count
        rows = pool.layout.max_rows * spec.num_kv_heads
        self.semaphores = torch.zeros(rows, dtype=torch.int32, device=pool.device).view(torch.uint32)
        chunk = spec.gqa_group * (8 + 2 * spec.head_dim)
        self.scratch = torch.zeros(2 * (self.sm_count + 2 * rows) * chunk + (1 << 16), dtype=torch.uint8, device=pool.device)
        self.modules = {w: get_xqa_module(spec.dtype, spec.kv_cache_dtype, spec.page_size, spec.head_dim, spec.gqa_group,
                                          w, spec.dtype, 1) for w in {g.window is not None for g in spec.groups}}

    def serves(self, g: int) -> bool:
        """Whether layer group g runs on XQA in decode steps (the groups other than cross: those with tables)."""
        return self.tables.table_of[g] is not None

    def memory(self) -> dict[str, tuple[int, int]]:
        n = self.semaphores.numel() * 4 + self.scratch.numel()
        return {"xqa semaphores + scratch": (n, 0), **self.tables.memory("xqa page tables")}


@attrs.frozen
class XqaDecode:
    """What `run` needs for one layer group of an XQA decode step: its page table [rows, width]
    int32 (device) and the pool's Xqa state."""

    table: torch.Tensor
    xqa: Xqa


def run_xqa(step: DeviceStep, q: torch.Tensor, cache: PagedKVCache, group: int, x: XqaDecode) -> torch.Tensor:
    """XQA's Hopper FP8 decode over q's rows (the step's requests, or a bucket's rows with padding).
    Logits = q_scale * kv_scale / sqrt(head_dim) * q . k_stored and output = kv_scale * p . v_stored,
    so kv_scale = v_scale and q_scale = sm_scale * k_scale / v_scale * sqrt(head_dim)."""
    spec, rows = step.plan.spec, q.shape[0]
    win = spec.groups[group].window
    q = q.contiguous()  # the kernel reads and writes dense [rows, heads, head_dim] rows
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    seq_lens = step.groups[group].kv_lens[:rows].view(torch.uint32).unsqueeze(1)
    table = x.table[:rows]
    q_scale = spec.sm_scale * cache.k_scale / cache.v_scale * spec.head_dim**0.5
    x.xqa.modules[win is not None].xqa(
        True, x.xqa.sm_count, spec.num_kv_heads, 0 if win is None else win, q_scale, out.unsqueeze(1), 1.0, q.unsqueeze(1),
        None, cache.k, cache.v, None, None, table, table.shape[1] * spec.page_size, seq_lens, rows, cache.v_scale,
        x.xqa.semaphores, x.xqa.scratch, True, 1, None, None)
    return out
