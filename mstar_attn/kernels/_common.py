"""Code shared by the GPU backends. Imports no GPU package."""

from __future__ import annotations

import torch


def write_kv(step, k: torch.Tensor, v: torch.Tensor, cache) -> None:
    """Store a committed step's new K/V in the paged cache, graph-safe.

    step: a DeviceStep. k, v: [T or step.num_rows, kv_heads, head_dim], the cache's dtype and
    device. Row t goes to flat slot step.slot_mapping[t] (int64 device); padding rows of a
    bucketed decode step rewrite row 0's values onto row 0's slot (step.write_src), so the
    write has a fixed shape per bucket and never touches another page.
    """
    k_flat, v_flat = cache.flat()
    k_flat.index_copy_(0, step.slot_mapping, k.index_select(0, step.write_src))
    v_flat.index_copy_(0, step.slot_mapping, v.index_select(0, step.write_src))
