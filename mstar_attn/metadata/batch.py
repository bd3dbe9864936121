"""The host-side description of one engine step, as an engine already holds it."""

from __future__ import annotations

import attrs
import numpy as np


def _i32(x) -> np.ndarray:
    """A read-only int32 copy: the batch owns its arrays, so plans can share them safely."""
    a = np.array(x, dtype=np.int32)
    a.flags.writeable = False
    return a


def _i32_or_none(x) -> np.ndarray | None:
    return None if x is None else _i32(x)


@attrs.frozen
class StepBatch:
    """One step's requests, all host (numpy) int32 arrays, B requests.

    q_lens      [B]      new query tokens of each request this step (>= 1)
    kv_lens     [B]      KV length of each request *after* this step (cached prefix + new tokens)
    page_indptr [B + 1]  CSR page table: request i owns page_indices[page_indptr[i]:page_indptr[i+1]]
    page_indices[nnz]    page ids, in sequence order; a request may own more pages than it uses
    block_table [B, P]   padded page table, when the engine holds one (row i, first pages used)
    page_size            tokens per page, must equal the cache's

    Build with `from_csr` or `from_block_table`, whichever the engine holds: the planner
    reads the CSR form, and keeps the block table for backends that want one. The batch
    copies its inputs once into read-only arrays (the engine may then mutate its own), and
    plans built from it share those arrays instead of copying again.
    """

    q_lens: np.ndarray = attrs.field(converter=_i32)
    kv_lens: np.ndarray = attrs.field(converter=_i32)
    page_indptr: np.ndarray = attrs.field(converter=_i32)
    page_indices: np.ndarray = attrs.field(converter=_i32)
    page_size: int
    block_table: np.ndarray | None = attrs.field(default=None, converter=_i32_or_none)

    @classmethod
    def from_csr(cls, q_lens, kv_lens, page_indptr, page_indices, page_size: int) -> StepBatch:
        return cls(q_lens, kv_lens, page_indptr, page_indices, page_size)

    @classmethod
    def from_block_table(cls, q_lens, kv_lens, block_table, page_size: int) -> StepBatch:
        """Keeps the block table and derives the CSR of the pages each request uses."""
        table = np.asarray(block_table, dtype=np.int32)
        kv = np.asarray(kv_lens, dtype=np.int32)
        if table.ndim != 2 or table.shape[0] != kv.shape[0]:
            from mstar_attn.metadata.spec import PlanError

            raise PlanError(f"block_table must be [B={kv.shape[0]}, max_pages], got shape {table.shape}")
        used = np.minimum((kv + (page_size - 1)) // page_size, table.shape[1])
        indptr = np.zeros(kv.shape[0] + 1, np.int32)
        np.cumsum(used, out=indptr[1:])
        indices = table[np.arange(table.shape[1]) < used[:, None]]
        return cls(q_lens, kv, indptr, indices, page_size, table)

    @classmethod
    def from_pages(cls, q_lens, kv_lens, pages: list, page_size: int) -> StepBatch:
        """From one list of page ids per request (tests and small engines)."""
        counts = np.fromiter((len(p) for p in pages), np.int32, len(pages))
        indptr = np.zeros(len(pages) + 1, np.int32)
        np.cumsum(counts, out=indptr[1:])
        indices = np.concatenate([np.asarray(p, np.int32) for p in pages]) if pages else np.zeros(0, np.int32)
        return cls(q_lens, kv_lens, indptr, indices, page_size)

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]
