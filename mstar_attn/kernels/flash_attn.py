"""FlashAttention-4 backend, on `flash_attn.cute.flash_attn_varlen_func` (flash-attn-4 4.0.0b36).

Two registry names share this module; `step.plan.backend` picks the call:
  "flash_attn"         every mode, over the paged cache: a dense page table [rows, width] int32
                       and seqused_k (the group's kv_lens), cu_seqlens_q = step.qo_indptr.
  "flash_attn_varlen"  prefill with no cached prefix, over the step's new k and v:
                       cu_seqlens_q = cu_seqlens_k = step.qo_indptr.

Host work (the page tables) runs in `GraphBufferPool.commit` through `PoolState`; `run` and
`write_kv` only launch kernels: no host sync, no allocation outside FA4's own `out`. What this
relies on in FA4 (interface.py, read for 4.0.0b36; notes/library_apis.md section 6):
  - num_splits=1 always: SM90 asserts "SplitKV not supported", and num_splits < 1 runs a
    heuristic that may pick > 1.
  - Compile key (`_flash_attn_fwd.compile_cache`): dtype, head dim, GQA ratio, causal, whether a
    window is set (not its size), the soft-cap value, which of cu_seqlens / seqused / page_table
    are given, pack_gqa, paged_kv_tma (page_size == tile_n, 128 for head dim 128), batch > 256,
    and is_static_persistent, which turns on when max_seqlen_q is given and max_seqlen_q * gqa
    fits one query tile (tile_m: 128 at head dim 128). Shapes and strides are dynamic. run
    passes max_seqlen_q = plan.max_q_len (1 for decode, the q_len a bucketed verify graph was
    captured with), so a group needs at most two kernels: short steps and long ones.
    Warm up every variant before capture (DecodeGraphs does).
  - The paged TMA loader reads whole pages, so rows past seqused_k must be finite: run refuses a
    cache not known finite (`PagedKVCache.allocate` zero-fills, `from_tensors` checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.steady import SteadyTerms
from mstar_attn.kernels import _check
from mstar_attn.kernels._common import write_kv  # noqa: F401  (this backend's write_kv)
from mstar_attn.kernels._tables import BlockTables
from mstar_attn.kernels.base import PoolStateBase
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan
from mstar_attn.metadata.spec import LayerGroup

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView
    from mstar_attn.capture.step import DeviceStep

VARLEN = "flash_attn_varlen"


def _varlen_func():
    """flash_attn.cute.flash_attn_varlen_func, imported on first use (sys.modules caches it)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise ImportError("mstar_attn backends 'flash_attn' and 'flash_attn_varlen' need FlashAttention-4 "
                          "(module flash_attn.cute): pip install flash-attn-4") from e
    return flash_attn_varlen_func


class PoolState(PoolStateBase):
    """Dense page tables for the pool's paged FlashAttention steps, filled at commit (kernels._tables.BlockTables)."""

    lazy_host_arrays = True  # reads no pinned host array of a derived StepRows step (its tables and lengths are on the device)
    schedule_reads_rows = True  # a CrossRows group's table: the step's device table_rows, gathered at schedule

    def __init__(self, pool: PoolView):
        _varlen_func()  # fail at pool construction, not at the first step
        self.tables = BlockTables(pool)

    def check(self, plan: AttentionPlan, bucket: int | None) -> None:
        """PlanError if a request reads more pages than the pool's max_pages_per_request (before any state changes)."""
        if plan.backend != VARLEN:
            self.tables.check(plan)

    def memory(self) -> dict[str, tuple[int, int]]:
        return self.tables.memory("flash_attn page tables")

    def gather(self, step: DeviceStep) -> None:
        """A StepRows step's page tables, gathered on the device (see BlockTables.gather)."""
        if step.plan.backend != VARLEN:
            self.tables.gather(step)

    def steady(self, step: DeviceStep) -> SteadyTerms | None:
        """A StepRows step's page tables are gathered on the device by its slot's work, for any lengths: its
        schedule (the slot's table views) serves every later decode step of its shape (None for varlen, and for a
        StepBatch step, whose tables schedule fills from its lists)."""
        return None if step.plan.backend == VARLEN or step.plan.rows is None else SteadyTerms(scheduled=step.scheduled)

    def schedule_round(self, steps: list[DeviceStep]) -> list[tuple]:
        """A draft round's steps list the same pages (each reads its own kv_lens): one set of tables for all."""
        return [self.schedule(steps[0])] * len(steps)

    def schedule(self, step: DeviceStep) -> tuple:
        """One entry per layer group: its page table, int32 device [rows, width] (None for varlen)."""
        if step.plan.backend == VARLEN:
            return (None,) * len(step.groups)
        return self.tables.schedule(step)


def _mask(group: LayerGroup) -> dict:
    """FA4's causal / window_size for a layer group: window W -> (W - 1, 0), bottom-right aligned."""
    return dict(causal=group.causal, window_size=(None, None) if group.window is None else (group.window_left, 0))


def run(step: DeviceStep, q: torch.Tensor, cache: PagedKVCache, group: int | None = None,
        k: torch.Tensor | None = None, v: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one layer of layer group `group` (required when the spec has own_pages groups,
    else default 0). Returns [q rows, qo_heads, head_dim], q.dtype.

    q: [rows, qo_heads, head_dim], spec.dtype (fp16 / bf16), on the cache's device. rows is
    plan.num_tokens; a bucketed step (decode, or verify of q_len step.q_len) also takes the
    padding requests' rows: any b * q_len rows with plan.batch_size <= b <= step.padded_batch_size (a captured
    graph passes step.padded_num_tokens, an eager caller the real tokens). k, v: [T, kv_heads, head_dim],
    the step's new keys and values, read only by "flash_attn_varlen" (the paged path reads the
    cache, so write_kv must run first). The paged path needs a cache known finite (see PagedKVCache).
    sinks: float32 [qo_heads] on q's device where the group has attention sinks (LayerGroup.sinks), else
    None: FA4's learnable sink.
    """
    plan = _check.step_plan(step, "run")
    group = _check.layer_group(group, plan, "run")
    sinks = _check.sinks(sinks, plan, group, q, "run")
    spec = plan.spec
    kw = dict(softmax_scale=spec.sm_scale, softcap=spec.soft_cap, num_splits=1, max_seqlen_q=plan.max_q_len,
              **_mask(spec.groups[group]))
    if sinks is not None:  # FA4's learnable sink: one more softmax column per head, natural-log units, no value (after
        kw["learnable_sink"] = sinks  # the soft-cap); part of FA4's compile key; its SM80 kernel has none (SM90+ only)
    if plan.backend == VARLEN:
        _check.cache_fits(cache, plan, "run", step=step, group=group)
        _check.query(q, step, plan, cache, "run")
        if k is None or v is None:
            raise PlanError("run: 'flash_attn_varlen' attends over the step's new K/V; pass k and v")
        _check.new_kv(k, v, step, plan, cache, "run")
        return _varlen_func()(q, k, v, cu_seqlens_q=step.qo_indptr, cu_seqlens_k=step.qo_indptr,
                              max_seqlen_k=plan.max_q_len, **kw)[0]
    _check.cache_fits(cache, plan, "run", finite=True, step=step, group=group)
    _check.query(q, step, plan, cache, "run")
    _check.stored_first(step, k, v, cache, group, "run")
    b = q.shape[0] // step.q_len if step.bucket is not None else plan.batch_size
    return _varlen_func()(q, cache.k, cache.v, cu_seqlens_q=step.qo_indptr[: b + 1], seqused_k=step.groups[group].kv_lens[:b],
                          page_table=step.scheduled[group][:b], **kw)[0]
