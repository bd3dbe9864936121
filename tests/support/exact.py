"""The scenarios' oracle: exact attention of one request in float64, on the device its keys live on (the
GPU scenarios keep their truth on the GPU: float64 there is exact too, and the oracle no longer
dominates a test's time), and each request's true K/V as it grows."""

from __future__ import annotations

import torch


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, soft_cap: float = 0.0,
                    causal: bool = True, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request's attention in float64 on k's device.

    q [n_q, Hq, D], the request's last n_q positions (any float dtype and device); k [n_k, Hkv, D] and
    v [n_k, Hkv, Dv] with Hq a multiple of Hkv (query head h reads KV head h // (Hq / Hkv)). A query at
    position p sees key j when j <= p (causal; every key if not) and j > p - window (window > 0).
    sinks [Hq] (attention sinks): each head's sink logit is one more column of its softmax, with no value
    (gpt-oss: the probabilities over [logits, sink], the sink's dropped). Returns [n_q, Hq, Dv] float64
    on k's device."""
    n_q, hq, d = q.shape
    n_k, hkv, dv = v.shape
    k, v = k.double(), v.double()
    qg = q.to(device=k.device, dtype=torch.float64).reshape(n_q, hkv, hq // hkv, d)
    logits = torch.einsum("qgrd,kgd->grqk", qg, k) * scale
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    pos = torch.arange(n_k - n_q, n_k, device=k.device)[:, None]
    key = torch.arange(n_k, device=k.device)[None, :]
    hidden = torch.zeros(n_q, n_k, dtype=torch.bool, device=k.device)
    if causal:
        hidden |= key > pos
    if window:
        hidden |= key <= pos - window
    logits = logits.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        column = sinks.to(device=k.device, dtype=torch.float64).reshape(hkv, hq // hkv, 1, 1).expand(-1, -1, n_q, 1)
        p = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(logits, dim=-1)
    return torch.einsum("grqk,kgd->qgrd", p, v).reshape(n_q, hq, dv)


class TrueKV:
    """A request's true K and V, float64 on `device`, appended per step ([n, Hkv, D] each), read as one
    tensor (the appended pieces are joined once, at the first read after them)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add tokens: k, v [n, Hkv, D] (values as the cache holds them, e.g. already rounded to bf16)."""
        self._k.append(k.to(device=self.device, dtype=torch.float64))
        self._v.append(v.to(device=self.device, dtype=torch.float64))

    def _join(self) -> None:
        if len(self._k) > 1:
            self._k, self._v = [torch.cat(self._k)], [torch.cat(self._v)]

    def __len__(self) -> int:
        return sum(x.shape[0] for x in self._k)

    def kv(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n tokens' K and V (all by default), [n, Hkv, D] float64 each."""
        self._join()
        return self._k[0][:n], self._v[0][:n]

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        self._join()
        if self._k:
            self._k, self._v = [self._k[0][:n]], [self._v[0][:n]]
