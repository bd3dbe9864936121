"""The paged KV cache: separate K and V tensors per layer, NHD layout.

Separate K and V (rather than one [pages, 2, ...] tensor) because both FlashInfer (a (k, v)
tuple) and FlashAttention (k_cache, v_cache) read them as they are, with no strided view.
"""

from __future__ import annotations

import attrs
import torch

from mstar_attn.metadata.spec import AttentionSpec


@attrs.frozen
class PagedKVCache:
    """k, v: [num_pages, page_size, num_kv_heads, head_dim], spec.dtype, on the compute device.

    Token at slot s (= page * page_size + offset) lives at k.view(-1, H, D)[s].
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, spec: AttentionSpec, device: torch.device | str = "cpu") -> PagedKVCache:
        """Zero-filled: FlashAttention-4's paged TMA loader reads whole pages, rows past a sequence's
        length included, and multiplies them by P = 0; they must be finite, never uninitialised."""
        shape = (spec.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        return cls(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_pages * page_size, H, D] views indexed by slot."""
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])
