"""The scenarios' oracle against a plain loop over heads and queries (query head h reads KV head
h // (Hq / Hkv); the mask written out position by position), on random shapes."""

import math

import pytest
import torch

from tests.helpers import fresh_seed
from tests.support.exact import TrueKV, exact_attention


def _loop(q, k, v, scale, soft_cap, causal, window, sinks=None):
    n_q, hq, _ = q.shape
    n_k, hkv, dv = v.shape
    out = torch.empty(n_q, hq, dv, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)].double(), v[:, h // (hq // hkv)].double()
        for i in range(n_q):
            p = n_k - n_q + i
            seen = [j for j in range(n_k) if (not causal or j <= p) and (not window or j > p - window)]
            s = torch.stack([q[i, h].double() @ kh[j] * scale for j in seen])
            if soft_cap:
                s = soft_cap * torch.tanh(s / soft_cap)
            if sinks is not None:  # the sink: one more exp(s_h) in the denominator, no value
                p = torch.exp(s - s.max())
                out[i, h] = p @ vh[seen] / (p.sum() + torch.exp(sinks[h].double() - s.max()))
                continue
            out[i, h] = torch.softmax(s, 0) @ vh[seen]
    return out


@pytest.mark.parametrize("case", range(12))
def test_exact_attention_equals_the_loop(case):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    hkv, rep = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    n_k = int(torch.randint(1, 40, (1,), generator=g))
    n_q = int(torch.randint(1, n_k + 1, (1,), generator=g))
    causal, window = case % 3 != 0, (int(torch.randint(1, 12, (1,), generator=g)) if case % 2 else 0)
    soft_cap = 0.0 if case % 4 < 2 else 20.0
    q = torch.randn(n_q, hkv * rep, 16, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(n_k, hkv, 16, generator=g, dtype=torch.bfloat16) * 3 for _ in range(2))
    want = _loop(q, k, v, 1 / math.sqrt(16), soft_cap, causal, window)
    got = exact_attention(q, k, v, scale=1 / math.sqrt(16), soft_cap=soft_cap, causal=causal, window=window)
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-12), f"seed {seed}"
    sinks = 2 * torch.randn(hkv * rep, generator=g)
    sinks[0] = sinks[0].abs() + 3  # (one head's sink weighs for sure: the control below; the others any sign)
    with_sinks = exact_attention(q, k, v, scale=1 / math.sqrt(16), soft_cap=soft_cap, causal=causal, window=window,
                                 sinks=sinks)
    assert torch.allclose(with_sinks, _loop(q, k, v, 1 / math.sqrt(16), soft_cap, causal, window, sinks), atol=1e-12,
                          rtol=1e-12), f"seed {seed}"
    assert not torch.allclose(with_sinks, want, atol=1e-3), f"seed {seed}"
    if hkv > 1:  # negative control: each query head reading the next KV head's keys and values
        wrong = exact_attention(q, k.roll(1, dims=1), v.roll(1, dims=1), scale=1 / math.sqrt(16), soft_cap=soft_cap,
                                causal=causal, window=window)
        assert not torch.allclose(wrong, want, atol=1e-3), f"seed {seed}"


def test_true_kv_appends_reads_and_truncates():
    t = TrueKV()
    a, b = torch.randn(3, 2, 4).to(torch.bfloat16), torch.randn(5, 2, 4).to(torch.bfloat16)
    t.append(a, -a)
    t.append(b, -b)
    k, v = t.kv()
    assert len(t) == 8 and k.dtype == torch.float64 and torch.equal(k, torch.cat([a, b]).double()) and torch.equal(v, -k)
    t.truncate(4)
    assert len(t) == 4 and torch.equal(t.kv()[0], k[:4]) and torch.equal(t.kv(2)[1], -k[:2])
