"""tuning.measure: the whole measuring pipeline on the CPU, FA4 modelled in plain torch, a host clock for
the CUDA events. Checks plumbing, not speed."""

import json
import time

import torch

from mstar_attn import tuning
from mstar_attn.kernels import flash_attn as fa
from mstar_attn.tuning import BenchConfig, Shape, derive_table, render_markdown


def fake_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                page_table=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, num_splits=1):
    """Causal attention as FA4 computes it (bottom-right aligned), paged or over new K/V."""
    assert causal and window_size == (None, None) and not softcap and num_splits == 1
    cu = cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[-2]
    for b in range(len(cu) - 1):
        if page_table is not None:
            n = int(seqused_k[b])
            pages = page_table[b, : -(-n // k.shape[1])].long()
            kb, vb = (x[pages].flatten(0, 1)[:n] for x in (k, v))
        else:
            kb, vb = k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]], v[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]
        qb = q[cu[b] : cu[b + 1]].float()
        kb, vb = (x.float().repeat_interleave(rep, dim=1) for x in (kb, vb))
        logits = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        sq, sk = qb.shape[0], kb.shape[0]
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", logits.masked_fill(hidden, float("-inf")).softmax(-1), vb).to(q.dtype)
    return out, None


class HostTimer:
    can_sleep = False

    def round(self, fn, reps, host_us):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return ts, False


def test_the_pipeline_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(fa, "_varlen_func", lambda: fake_varlen)
    kw = dict(heads=(4, 2), head_dim=64, page_size=16)
    shapes = [Shape("decode", 4, 1, 40, **kw), Shape("prefill", 2, 24, 0, **kw), Shape("verify", 2, 3, 30, **kw),
              Shape("extend", 2, 10, 30, **kw), Shape("mixed", 2, 10, 30, decodes=3, **kw)]
    cfg = BenchConfig(rounds=2, reps=3, warmup=1, commit_reps=2, flush_bytes=1)
    logs = []
    r = tuning.run_grid(shapes, tmp_path, cfg, logs.append, device="cpu", timer=HostTimer(),
                        ceilings={"copy_TBps": 1.0, "matmul_TFLOPs": 1.0})
    assert json.loads((tmp_path / "backend_grid.json").read_text()) == json.loads(json.dumps(r))
    assert [s["name"] for s in r["shapes"]] == [s.name for s in shapes] and len(logs) == len(shapes) + 1
    for s in r["shapes"]:
        res = s["results"]
        prefill = s["plan"]["mode"] == "prefill"
        assert set(res) == ({"flashinfer", "flashinfer_ragged", "flash_attn", "flash_attn_varlen"} if prefill
                            else {"flashinfer", "flash_attn"})
        for name in ("flash_attn", "flash_attn_varlen") if prefill else ("flash_attn",):
            a = res[name]
            assert a["status"] == "ok", a
            assert a["rel_err"] < tuning.TOL and len(a["samples_us"]) == 6 and a["median_us"] > 0
            assert len(a["round_medians_us"]) == 2 and a["spread"] >= 0 and a["commit_us"] > 0
        assert res["flashinfer"]["status"].split(":")[0] in ("unavailable", "error")  # no GPU here
    md = render_markdown(r, derive_table(r))
    assert "decode B=4 ctx=41" in md
