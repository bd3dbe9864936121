"""`PoolView`: what a backend's PoolState and the commit checks read of a pool, and nothing else.

The pool (pool.py) makes one at construction and hands it to every backend state and check: its spec and
bounds, its device, the slots' staging and device buffers, its page tables, and three services (upload,
stage_host, index_buffer). The pool's commit bookkeeping (leases, generations, deferred work, kept views) is
not in it: a backend never reaches into the commit transaction, and no module below the pool imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs
import torch

from mstar_attn.capture.step import forwarded

if TYPE_CHECKING:
    from mstar_attn.capture.limits import Sizing
    from mstar_attn.capture.step import DeviceStep
    from mstar_attn.capture.table import PageTable
    from mstar_attn.metadata.spec import AttentionSpec


def _sized(name: str, doc: str) -> property:
    return forwarded("sizing", name, f"{doc} (Sizing.{name})")


class SizedBounds:
    """The bounds a pool's Sizing holds, read through `self.sizing` (a field or attribute of the subclass): the
    pool and its PoolView read them alike."""

    layout = _sized("layout", "Layout: where each array of a step sits in a slot")
    buckets = _sized("buckets", "tuple[int, ...]: the captured batch sizes, ascending")
    bucket_at = _sized("bucket_at", "tuple: batch size -> the bucket serving it")
    verify_buckets = _sized("verify_buckets", "bool: whether verify steps are bucketed")
    max_verify_q_len = _sized("max_verify_q_len", "int: the longest q_len a bucketed step has")
    max_num_tokens = _sized("max_num_tokens", "int")
    max_num_pages = _sized("max_num_pages", "int")
    max_encoder_tokens = _sized("max_encoder_tokens", "int")
    max_pages_per_request = _sized("max_pages_per_request", "int")
    max_draft_steps = _sized("max_draft_steps", "int")


@attrs.frozen(eq=False)
class PoolView(SizedBounds):
    """A pool's spec, bounds (its Sizing) and device; per slot its staging (host: pinned int32 [layout.size]) and
    device twin (dev: int32 [layout.size] on `device`); its page tables (None without max_requests or cross
    groups); FlashInfer's float workspace size; and the services a backend state calls:

    upload(dst, src)    dst.copy_(src) without blocking, counted in the pool's bytes_to_device
    stage_host(step)    a derived step's O(rows) arrays written into its slot's pinned staging (once)
    """

    spec: AttentionSpec
    sizing: Sizing
    device: torch.device
    host: list  # [num_slots] pinned int32 tensors (CPU tensors on a CPU pool)
    dev: list  # [num_slots] int32 tensors on `device`
    table: PageTable | None
    cross_table: PageTable | None
    float_workspace_bytes: int
    upload: Callable[[torch.Tensor, torch.Tensor], None]
    stage_host: Callable[[DeviceStep], None]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def num_slots(self) -> int:
        return len(self.host)

    def index_buffer(self, step: DeviceStep, group: int) -> torch.Tensor:
        """The whole index region [index_capacity] of `group` for the step's slot and shape (int32, on the device):
        what a FlashInfer graph-mode wrapper is built over (its buffers must outlive every plan)."""
        at = self.layout.at(step.padded_batch_size, step.padded_num_tokens).groups[group].indices
        return self.dev[step.slot][at : at + self.layout.index_capacity]
