"""FlashInfer backend (the default): paged decode / prefill / extend / verify, ragged prefill.

Host-side scheduling (`wrapper.plan`) runs in `GraphBufferPool.commit`, through `PoolState`,
from pinned host arrays (indptr, last_page_len, kv lens) and the slot's device page indices:
no device-to-host copy, never inside a graph. `run` and `write_kv` check their arguments on the
host and launch kernels. Uses FlashInfer's public wrapper API (tests/kernels/test_flashinfer.py
checks the signatures this module calls), except `_flashinfer_fast` (pinned): the re-plan of
graph-mode decode wrappers and the int workspaces the pool owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import flashinfer
import torch

from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.steady import SteadyTerms
from mstar_attn.kernels import _cascade, _check
from mstar_attn.kernels import _flashinfer_tree
from mstar_attn.kernels._flashinfer_tree import TreeRun, TreeState
from mstar_attn.kernels._common import with_sinks, write_kv  # noqa: F401  (write_kv: this backend's)
from mstar_attn.kernels._flashinfer_fast import FastDecodePlan, graph_workspace_bytes, share_workspace, split_kv, supported
from mstar_attn.kernels._xqa import Xqa, XqaDecode, run_xqa  # noqa: F401  (XqaDecode: what run reads of an XQA step)
from mstar_attn.kernels.base import PoolStateBase
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.groups import window_decode_ranges
from mstar_attn.metadata.plan import AttentionPlan, Mode
from mstar_attn.metadata.spec import Kind

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView
    from mstar_attn.capture.step import DeviceStep

INT_WORKSPACE_BYTES = 8 << 20  # what every FlashInfer wrapper allocates for its plan
# A bucket whose requests x KV heads reach this many CTAs per SM of the GPU is planned once, without
# split-KV, and never re-planned (see PoolState); below it split-KV pays for small batches over
# long contexts, and the schedule is re-planned per step (benchmarks/host_step.py part b measures both)
FIXED_CTAS_PER_SM = 2


@attrs.frozen
class KeptStep:
    """The kept plans of one bucketed step shape (slot, padded batch, q_len, mode) once every layer group has one:
    per group its wrapper, and the groups whose plan splits KV (`split`: re-planned when a chunk count changes;
    the others were planned once for good)."""

    wrappers: tuple
    split: tuple  # SplitGroup, one per group with a FastDecodePlan


@attrs.frozen
class SplitGroup:
    """A KeptStep's layer group whose plan splits KV: its index, its FastDecodePlan, whether the group's kv_lens
    are the plan's own (PoolState.plain)."""

    group: int
    plan: FastDecodePlan
    plain: bool


class PoolState(PoolStateBase):
    """The pool's FlashInfer wrappers, planned at commit from pinned host arrays.

    Bucketed steps (decode, and verify) use graph-mode decode wrappers keyed by (slot, group, padded batch,
    q_len) over the slot's own device buffers, so a graph captured on one replays whatever the
    latest commit planned. A bucket of requests x KV heads >= fixed_min_ctas (FIXED_CTAS_PER_SM per SM)
    is planned once with split-KV off (each request one chunk, its length read by the kernel at run
    time), so its plan holds for any lengths and is never redone: no host scheduling per step.
    Smaller buckets keep split-KV and are re-planned at every commit through `FastDecodePlan` (the
    C++ planner alone, after the wrapper's first public plan()). Verify uses tensor cores (FlashInfer's multi-token
    decode: causal, bottom-right aligned). Other steps use eager wrappers, one per (kind, slot,
    group): decode past the largest bucket, paged prefill for prefill / extend / mixed, ragged
    prefill when the plan names "flashinfer_ragged".

    Memory: one float workspace for the pool (kernels of one stream never overlap). Each graph-mode wrapper
    plans into an int workspace of its own (graph_workspace_bytes, with its pinned mirror), so its plan lasts
    until it plans again, whatever other wrappers of its slot plan meanwhile (a mixed step, another bucket).
    The eager wrappers (planned at every commit) share one int workspace plus its pinned mirror per (slot,
    group): a slot holds one step at a time, and the pool replans a slot only after the copies of its last
    commit ran (the slot's event: a commit that planned is never proven by a fence alone).

    Draft rounds (pool.commit_round): the K steps are live together, so step j has wrappers of its
    own (keys end with j), always on tensor cores (their planner splits KV by each request's length,
    never past it, and a draft step lists pages ahead of its length); an eager one plans into the j-th of
    max_draft_steps equal parts of the slot and group's int workspace. Bucketed draft steps use the
    fixed schedule (planned once, split-KV off) while `draft_fixed` is set, the default (read when a
    step's wrapper is first planned: set it before the pool's first round).
    """

    lazy_host_arrays = True  # a derived StepRows step's pinned arrays are staged only when a planner reads them

    def __init__(self, pool: PoolView):
        if pool.device.type != "cuda":
            raise PlanError(f"GraphBufferPool(device={pool.device}): the FlashInfer backend runs on CUDA")
        self.pool = pool
        spec = pool.spec
        self.float_ws = torch.zeros(pool.float_workspace_bytes, dtype=torch.uint8, device=pool.device)
        groups = range(len(spec.groups))
        self.int_ws = [[torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device) for _ in groups]
                       for _ in range(pool.num_slots)]
        self.pinned_ws = [[torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in groups]
                          for _ in range(pool.num_slots)]
        self.tensor_cores = spec.gqa_group >= 4 or spec.fp8_kv  # FlashInfer's advice for decode (its CUDA-core FP8 decode is slow)
        self.wrappers: dict[tuple, object] = {}
        self.fast: dict[tuple, FastDecodePlan] = {}
        self.fixed: dict[tuple, object] = {}  # (slot, group, padded batch, q_len[, draft step]) -> its wrapper, planned once for good
        # per layer group: whether its kv_lens are the plan's own (not a window's, an own list's or the encoder's;
        # tests/metadata/test_record.py holds every plan form to it)
        self.plain = tuple(g.kind is not Kind.WINDOW and i not in spec.own_page_groups for i, g in enumerate(spec.groups))
        self.kept_steps: dict[tuple, KeptStep] = {}  # (slot, padded batch, q_len, mode) -> its groups' kept plans (schedule)
        self.private: list[tuple[torch.Tensor, torch.Tensor]] = []  # the graph-mode wrappers' int workspaces (and mirrors)
        self.sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
        self.fixed_min_ctas = 1 << 62 if FIXED_CTAS_PER_SM is None else FIXED_CTAS_PER_SM * self.sms
        self.use_fast = supported(flashinfer)
        # a draft round's bucketed steps are planned once, without split-KV, and never again: one planner
        # call per step and group would cost each round K times a decode step's (benchmarks/results/draft_round_h100.md)
        self.draft_fixed = True
        self.xqa = Xqa(pool) if spec.fp8_math else None
        self.cascade = _cascade.CascadeState(self) if spec.cascade_groups else None  # shared-prefix steps
        self.trees: TreeState | None = None  # token-tree verify steps' masks and staging: made at the first one
        self.plan_kwargs = dict(  # the same for every plan() call of this pool
            logits_soft_cap=spec.soft_cap or None, q_data_type=spec.dtype, kv_data_type=spec.kv_cache_dtype,
            sm_scale=spec.sm_scale, non_blocking=True,
        )

    def check(self, plan: AttentionPlan, bucket: int | None) -> None:
        """XQA decode (fp8_math): PlanError if a request reads more pages than the pool's
        max_pages_per_request. Nothing else to refuse beyond what build_plan and the pool check (a token-tree
        step's mask, q x q bits a request, always fits its buffers)."""
        if self.xqa is not None and self._on_xqa(plan):
            self.xqa.tables.check(plan)

    def gather(self, step: DeviceStep) -> None:
        """A StepRows step's XQA page tables, on the device (fp8_math decode), after the pool's CSR page lists."""
        if self._on_xqa(step.plan):
            self.xqa.tables.gather(step)

    def _on_xqa(self, plan: AttentionPlan) -> bool:
        """fp8_math decode steps (one query token per request, draft steps included) run on XQA."""
        return self.xqa is not None and plan.mode is Mode.DECODE

    def memory(self) -> dict[str, tuple[int, int]]:
        """The shared workspaces, and what the wrappers own beyond them and the pool's buffers."""
        n = sum(len(x) for x in self.int_ws) * INT_WORKSPACE_BYTES
        private = [t for pair in self.private for t in pair]
        shared = {t.untyped_storage().data_ptr() for t in
                  (self.float_ws, *sum(self.int_ws, []), *sum(self.pinned_ws, []), *self.pool.dev, *self.pool.host, *private,
                   *(self.cascade.tensors() if self.cascade is not None else ()),
                   *(self.trees.tensors() if self.trees is not None else ()))}  # (counted by their owners)
        own = [0, 0]
        for w in (*self.wrappers.values(), *(self.cascade.wrappers.values() if self.cascade is not None else ()),
                  *(self.trees.wrappers.values() if self.trees is not None else ())):
            for t in vars(w).values():
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                    shared.add(t.untyped_storage().data_ptr())
                    own[0 if t.is_cuda else 1] += t.untyped_storage().nbytes() if (t.is_cuda or t.is_pinned()) else 0
        m = sum(ws.numel() for ws, _ in self.private)
        return {**(self.xqa.memory() if self.xqa is not None else {}),
                **(self.cascade.memory() if self.cascade is not None else {}),
                **(self.trees.memory() if self.trees is not None else {}), "flashinfer float workspace": (self.float_ws.numel(), 0), "flashinfer int workspaces": (n, n),
                f"flashinfer graph-mode int workspaces ({len(self.private)})": (m, m),
                f"flashinfer wrappers' own buffers ({len(self.wrappers)} wrappers)": tuple(own)}

    def schedule(self, step: DeviceStep, tables: tuple | None = None) -> tuple:
        """One entry per layer group: its planned wrapper, an XqaDecode (fp8_math decode), or the
        cascade group's Levels (a cascade step: plan.cascade)."""
        plan = step.plan
        if plan.tree is not None:  # a token-tree verify step: prefix and tree merged (_flashinfer_tree.py)
            if self.trees is None:
                self.trees = TreeState(self)
            return self.trees.schedule(step)
        sh = step.shape  # (its fields read directly: the per-step path)
        if sh.bucket is not None and plan.draft_step is None and plan.cascade is None:  # a bucketed shape planned before
            kept = self.kept_steps.get((sh.slot, sh.padded_batch_size, sh.q_len, plan.mode))
            if kept is not None:
                return self._kept(step, kept)
        if plan.cascade is not None:
            levels = self.cascade.schedule(step)
            return tuple(levels[g] if g in levels else self._plan(step, g, dg) for g, dg in enumerate(step.groups))
        x = self.xqa
        if self._on_xqa(step.plan):
            tables = x.tables.schedule(step) if tables is None else tables
            return tuple(XqaDecode(tables[g], x) if x.serves(g) else self._plan(step, g, dg)
                         for g, dg in enumerate(step.groups))
        out = tuple(self._plan(step, g, dg) for g, dg in enumerate(step.groups))
        if step.bucket is not None and plan.draft_step is None:
            keys = [(step.slot, g, step.padded_batch_size, step.q_len) for g in range(len(out))]
            if all(k in self.fixed or k in self.fast for k in keys):  # (every group planned by its kept plan from now on)
                split = tuple(SplitGroup(group=g, plan=self.fast[k], plain=self.plain[g])
                              for g, k in enumerate(keys) if k not in self.fixed)
                self.kept_steps[(step.slot, step.padded_batch_size, step.q_len, plan.mode)] = KeptStep(wrappers=out, split=split)
        return out

    def _kept(self, step: DeviceStep, kept: KeptStep) -> tuple:
        """schedule for a shape whose groups all have a kept plan: the kept wrappers, each split-KV group's planned
        again where its plan no longer holds (see _plan)."""
        out, plan = None, step.plan
        for sg in kept.split:  # (none: every group planned once for good)
            if not sg.plan.holds(plan.kv_lens if sg.plain else plan.kv_lens_of(sg.group)):
                out = list(kept.wrappers) if out is None else out
                out[sg.group] = self._plan(step, sg.group, step.groups[sg.group])
        return kept.wrappers if out is None else tuple(out)

    def steady(self, step: DeviceStep) -> SteadyTerms | None:
        """After schedule: the shape's kept wrappers (each plans into an int workspace of its own: no other plan
        overwrites theirs), while each split-KV group's chunk counts hold: its ChunkRanges over the step's B requests
        (the bucket's other requests counting as padding ones), over the plan's kv_lens, or for a window group over
        its own lengths, mapped back to the plan's (groups.window_decode_ranges), or for a listed step's cross group
        of cross-table rows (AttentionPlan.lazy_cross) over its encoder lengths (SteadyTerms.cross). None for a step
        whose schedule is not kept (XQA, a shape not yet kept) or whose split-KV group keeps its own page list.
        (The pool asks for plain decode steps only: steady.decode_rows and decode_lists.)"""
        plan, sh = step.plan, step.shape
        kept = None if self._on_xqa(plan) else self.kept_steps.get((sh.slot, sh.padded_batch_size, sh.q_len, plan.mode))
        if kept is None or any(a is not b for a, b in zip(step.scheduled, kept.wrappers)):
            return None
        spec, ranges, cross = self.pool.spec, [], None
        for sg in kept.split:
            r, group = sg.plan.chunks.over(plan.batch_size), spec.groups[sg.group]
            if r is None:
                return None
            if group.cross and plan.lazy_cross is not None:  # (its chunks: over the encoder lengths)
                cross = r
            elif sg.plain or group.kind is Kind.WINDOW and sg.group not in spec.own_page_groups:
                ranges.append(r if sg.plain else window_decode_ranges(group, plan.kv_lens, r, spec.page_size))
            else:
                return None
        return SteadyTerms(scheduled=kept.wrappers, ranges=tuple(ranges), cross=cross)

    def schedule_round(self, steps: list[DeviceStep]) -> list[tuple]:
        """A draft round: XQA's page tables once (the steps list the same pages), the wrappers per step."""
        tables = self.xqa.tables.schedule(steps[0]) if self._on_xqa(steps[0].plan) else None
        return [self.schedule(st, tables) for st in steps]

    def _plan(self, step: DeviceStep, g: int, dg):
        spec, group = self.pool.spec, self.pool.spec.groups[g]
        draft = step.plan.draft_step  # a round's steps are live together: a wrapper (and int workspace part) each
        if step.bucket is not None:
            key = (step.slot, g, step.padded_batch_size, step.q_len) + (() if draft is None else (draft,))
            w = self.fixed.get(key)
            if w is not None:
                return w
            fast = self.fast.get(key)
            lens = step.plan.kv_lens_of(g)  # (a plan holds while every request's KV chunk count does)
            if fast is not None:
                # the plan lives in the wrapper's own int workspace: kept while every request's chunk count is
                # the same (a draft step's pages run ahead of its lengths: planned every time)
                if draft is not None or not fast.holds(lens):
                    self.pool.stage_host(step)
                    fast.replan(step.host_qo_indptr, dg.host_kv_indptr, dg.host_kv_lens)
                    fast.plans(lens)
                return fast.wrapper
            self.pool.stage_host(step)
            heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
            fix = self.use_fast and (step.padded_batch_size * spec.num_kv_heads >= self.fixed_min_ctas
                                     or (draft is not None and self.draft_fixed))
            w = self.wrappers.get(("graph",) + key)  # one per key for life: captured graphs point into it
            if w is None:
                w = self.wrappers[("graph",) + key] = self._graph_wrapper(step, g)
            w.plan(dg.host_kv_indptr, dg.listed(), dg.host_last_page_len, *heads, spec.page_size,
                   window_left=group.window_left, seq_lens=dg.host_kv_lens, q_len_per_req=step.q_len,
                   **({"disable_split_kv": True} if fix else {}), **self.plan_kwargs)
            if fix and not split_kv(w):  # (the CUDA-core planner ignores the flag: it splits below ~9 CTAs / SM)
                self.fixed[key] = w
                return w
            if self.use_fast:
                try:
                    self.fast[key] = FastDecodePlan(w, spec, group.window_left, step.q_len, step.padded_batch_size)
                    self.fast[key].plans(lens)
                except RuntimeError:  # internals not as expected: this wrapper keeps the public plan()
                    pass
            return w
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim)
        if draft is not None:  # tensor cores: their planner splits KV by each request's length, never past it
            w = self.eager(("draft", step.slot, g, draft), flashinfer.BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=True)
            w.plan(dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads, spec.page_size,
                   window_left=group.window_left, seq_lens=dg.host_kv_lens, **self.plan_kwargs)
        elif step.mode is Mode.DECODE:
            w = self.eager(("decode", step.slot, g), flashinfer.BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=self.tensor_cores)
            w.plan(dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads, spec.page_size,
                   window_left=group.window_left, seq_lens=dg.host_kv_lens, **self.plan_kwargs)
        elif step.plan.backend == "flashinfer_ragged":
            w = self.eager(("ragged", step.slot, g), flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
            w.plan(step.host_qo_indptr, step.host_qo_indptr, *heads, causal=group.causal,
                   window_left=group.window_left, **{**self.plan_kwargs, "kv_data_type": spec.dtype})  # (new K/V, not the cache)
        else:
            w = self.eager(("prefill", step.slot, g), flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            w.plan(step.host_qo_indptr, dg.host_kv_indptr, dg.kv_indices, dg.host_last_page_len, *heads,
                   spec.page_size, causal=group.causal, window_left=group.window_left, seq_lens=dg.host_kv_lens,
                   **self.plan_kwargs)
        return w

    def share(self, w, slot: int, g: int, draft: int | None = None):
        """Point w at slot and group's int workspace: the whole of it, or for step j of a draft round
        its j-th of max_draft_steps equal parts (the round's steps are planned, and live, together). Only
        wrappers planned at every commit share it: no plan there outlives the slot's next commit."""
        ws, pinned = self.int_ws[slot][g], self.pinned_ws[slot][g]
        if draft is not None:
            n = INT_WORKSPACE_BYTES // self.pool.max_draft_steps // 4096 * 4096
            ws, pinned = ws[draft * n : (draft + 1) * n], pinned[draft * n : (draft + 1) * n]
        share_workspace(w, self.float_ws, ws, pinned)
        return w

    def eager(self, key: tuple, cls, **kw):
        """The eager wrapper of `key` ((kind, slot, group[, draft step])), made on first use over the slot and
        group's int workspace."""
        w = self.wrappers.get(key)
        if w is None:
            draft = key[3] if key[0] == "draft" else None
            w = self.wrappers[key] = self.share(cls(self.float_ws, "NHD", **kw), key[1], key[2], draft)
        return w

    def _graph_wrapper(self, step: DeviceStep, g: int):
        """A graph-mode decode wrapper over the step's buffers, with an int workspace of its own: its plan is
        kept across commits (planned once for good, or until a chunk count changes), which a workspace shared
        with the slot's other wrappers would overwrite (the kernel would then read another plan's work list)."""
        dg = step.groups[g]
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.float_ws, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores or step.q_len > 1 or step.plan.draft_step is not None,
            paged_kv_indptr_buffer=dg.kv_indptr, paged_kv_indices_buffer=self.pool.index_buffer(step, g),
            paged_kv_last_page_len_buffer=dg.kv_last_page_len,
        )
        spec = self.pool.spec
        size = graph_workspace_bytes(step.padded_batch_size, step.q_len, spec.gqa_group, spec.num_kv_heads, self.sms)
        ws = torch.zeros(size, dtype=torch.uint8, device=self.pool.device)
        pinned = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        self.private.append((ws, pinned))
        share_workspace(w, self.float_ws, ws, pinned)
        return w


def run(step: DeviceStep, q: torch.Tensor, cache: PagedKVCache, group: int | None = None,
        k: torch.Tensor | None = None, v: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one layer of layer group `group` (required when the spec has own_pages groups, else default 0).

    q: [T, qo_heads, head_dim] (a bucketed step also takes its padding requests' rows, see
    DeviceStep.accepts_rows), spec.dtype, on the cache's device; returns the same number of rows.
    k, v: the step's new keys and values [T, kv_heads, head_dim], needed only when the plan names
    "flashinfer_ragged" (attention over the new tokens alone). An FP8 cache is read with its
    k_scale / v_scale (host floats: a captured graph keeps the scales of the cache it captured).
    """
    plan = _check.step_plan(step, "run")
    group = _check.layer_group(group, plan, "run")
    sinks = _check.sinks(sinks, plan, group, q, "run")
    lse = sinks is not None  # sinks: applied to the output by its log-sum-exp (base 2 from FlashInfer), in the graph
    w = step.scheduled[group]
    # XQA reads whole 64-token tiles (masking logits, not values): the rows past a length must be finite
    _check.cache_fits(cache, plan, "run", finite=isinstance(w, XqaDecode), step=step, group=group)
    _check.query(q, step, plan, cache, "run")
    if plan.backend != "flashinfer_ragged":  # (k and v are read from the cache: stored first)
        _check.stored_first(step, k, v, cache, group, "run")
    if isinstance(w, XqaDecode):
        return run_xqa(step, q, cache, group, w)
    if isinstance(w, _cascade.Levels):
        return _cascade.run(step, q, cache, w, sinks)
    # an FP8 cache: FlashInfer folds k_scale into the softmax scale (the lse too) and scales the output by v_scale
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale) if plan.spec.fp8_kv else {}
    if isinstance(w, TreeRun):
        return _flashinfer_tree.run(step, q, cache, w, sinks, scales)
    if plan.backend == "flashinfer_ragged":
        if k is None or v is None:
            raise PlanError("run: this step is planned as ragged attention (flashinfer_ragged); pass its k and v")
        _check.new_kv(k, v, step, plan, cache, "run")
        return w.run(q, k, v)  # (no sinks: flashinfer_ragged does not declare them, so no sink spec reaches it)
    rows = q.shape[0]
    if rows < step.padded_num_tokens:  # eager call on a bucket-padded step: padding requests read the scratch page
        q = torch.cat([q, q[:1].expand(step.padded_num_tokens - rows, -1, -1)])
    if lse:
        return with_sinks(*w.run(q, (cache.k, cache.v), return_lse=True, **scales), sinks, lse_base2=True, fused=True)[:rows]
    return w.run(q, (cache.k, cache.v), **scales)[:rows]
