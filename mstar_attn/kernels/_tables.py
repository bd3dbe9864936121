"""Dense page tables [rows, width] int32, filled at commit: FlashAttention-4's paged path and FlashInfer's
XQA decode (AttentionSpec.fp8_math) read them instead of CSR page lists. Imports no GPU package."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.plan import AttentionPlan
from mstar_attn.metadata.spec import Kind

if TYPE_CHECKING:
    from mstar_attn.capture.view import PoolView
    from mstar_attn.capture.step import DeviceStep


class BlockTables:
    """Per pool slot and per table: a zeroed pinned host int32 buffer [max_batch * max_pages_per_request]
    and its device twin. Layer groups that read the plan's own pages (full and non-causal) share
    table 0; each window group (whose plan trims front pages) and each group with its own page
    list (LayerGroup.own_pages) has its own. A step's table is the buffer's first rows * width
    entries viewed [rows, width]: width = max_pages_per_request for bucketed steps (decode, verify:
    the shape graphs were captured with), the step's widest request otherwise. Padding requests of
    a bucketed step read the scratch page. Row i lists request i's pages (a window group's from its
    first kept page on); columns past them hold stale but valid page ids (the buffers start at 0,
    and every entry ever written is a page id), so a kernel reading whole tables stays in the cache.
    The pool proves each commit after scheduling (an event, since schedule uploads from these buffers),
    so a slot's pinned buffer is rewritten only once its last copy has run.

    Cost: 2 * num_slots * tables * max_batch * max_pages_per_request * 4 bytes (pinned + device),
    and a bucketed commit of a StepBatch copies rows * max_pages_per_request * 4 bytes per table. A
    StepRows step copies none: `gather` fills its tables from the pool's page table on the device. Size
    the pool's max_pages_per_request to the longest context / page_size, not the whole pool.
    """

    def __init__(self, pool: PoolView, groups: list[int] | None = None):
        """groups: the layer groups that read tables (default all); the others get None from schedule."""
        self.pool = pool
        served = range(len(pool.spec.groups)) if groups is None else groups
        alone = {g: pool.spec.groups[g].kind is Kind.WINDOW or pool.spec.groups[g].own_pages for g in served}
        shared = 0 if not all(alone.values()) else -1
        self.table_of, n = [None] * len(pool.spec.groups), shared + 1  # group -> its table (None: not served)
        for g, a in alone.items():
            self.table_of[g] = n if a else shared
            n += a
        self.firsts = {}  # table -> the first group that reads it (groups sharing a table read the same pages)
        for g in alone:
            self.firsts.setdefault(self.table_of[g], g)
        size = pool.layout.max_rows * pool.max_pages_per_request
        pin = pool.device.type == "cuda"
        self.host = [[torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(n)] for _ in range(pool.num_slots)]
        self.host_np = [[h.numpy() for h in hs] for hs in self.host]
        self.dev = [[torch.zeros(size, dtype=torch.int32, device=pool.device) for _ in range(n)] for _ in range(pool.num_slots)]

    def check(self, plan: AttentionPlan) -> None:
        """PlanError if a request reads more pages than the pool's max_pages_per_request (before any state changes).
        A StepRows plan needs no check here: its rows are the pool's table, max_pages_per_request wide, and
        the table refuses a longer request (PageTable.check_step) without deriving the plan's arrays."""
        if plan.rows is not None:
            return
        limit = self.pool.max_pages_per_request
        for t, g in self.firsts.items():
            c = np.diff(plan.groups[g].kv_indptr)
            if c.max() > limit:
                i = int(np.argmax(c))
                raise PlanError(f"commit: group {g}, request {i} reads {c[i]} pages, more than the pool's "
                                f"max_pages_per_request {limit}")

    def memory(self, label: str) -> dict[str, tuple[int, int]]:
        n = sum(t.numel() * 4 for ts in self.dev for t in ts)
        return {label: (n, n if self.pool.device.type == "cuda" else 0)}

    def _table(self, step: DeviceStep, t: int, width: int) -> torch.Tensor:
        return self.dev[step.slot][t][: step.padded_batch_size * width].view(step.padded_batch_size, width)

    def gather(self, step: DeviceStep) -> None:
        """A StepRows step's page tables, gathered on the device from the pool's page table
        (capturable: the pool runs it inside its per-bucket graph): [rows, table width] of the
        step's rows, shifted left by each request's first page for a window group. No host copy."""
        table = self.pool.table
        full = table.dev[:-1].view(-1, table.width)
        for t, g in self.firsts.items():
            out = self._table(step, t, table.width)
            if step.plan.groups[g].kv_start is None:
                torch.index_select(full, 0, step.table_rows, out=out)
            else:  # column j of request i: table column first_page[i] + j (the tail clamped: a valid page)
                cols = torch.arange(table.width, device=out.device) + step.groups[g].first_page[:, None]
                torch.gather(full.index_select(0, step.table_rows), 1, cols.clamp_(max=table.width - 1), out=out)

    def schedule(self, step: DeviceStep) -> tuple:
        """One entry per layer group: its page table, int32 device [rows, width] (None: a group not served)."""
        plan = step.plan
        if plan.rows is not None:  # filled on the device by gather
            return tuple(None if t is None else self._table(step, t, self.pool.table.width) for t in self.table_of)
        B, rows, ps = plan.batch_size, step.padded_batch_size, plan.spec.page_size
        pad_pages = -(-step.q_len // ps)  # a padding request reads q_len tokens of the scratch page
        tables = {}
        for t, g in self.firsts.items():
            gp = plan.groups[g]
            if gp.kv_indices is None:  # CrossRows: the rows of the pool's cross table, gathered on the device
                xt = self.pool.cross_table
                tables[t] = self._table(step, t, xt.width)
                torch.index_select(xt.dev[:-1].view(-1, xt.width), 0, step.table_rows, out=tables[t])
                continue
            c = np.diff(gp.kv_indptr)
            width = self.pool.max_pages_per_request if step.bucket is not None else int(c.max())
            n = rows * width
            table = self.host_np[step.slot][t][:n].reshape(rows, width)
            row = np.repeat(np.arange(B), c)
            table[row, np.arange(gp.kv_indices.shape[0]) - gp.kv_indptr[row]] = gp.kv_indices
            table[B:, :pad_pages] = plan.spec.scratch_page
            dev = self.dev[step.slot][t][:n]
            self.pool.upload(dev, self.host[step.slot][t][:n])
            tables[t] = dev.view(rows, width)
        return tuple(None if t is None else tables[t] for t in self.table_of)
