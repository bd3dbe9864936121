"""H100: the split extend path on the backend grid's extend and mixed shapes, side by side in one run
with the two paths the dispatcher picks between for those steps (the pool's FlashInfer paged and
FlashAttention-4 paged backends).

    python -m benchmarks.split_extend_grid OUT.json          (GPU)
    python -m benchmarks.split_extend_grid --md IN.json OUT.md   (the Markdown, CPU)

Shapes: every "extend" and "mixed" shape of mstar_attn.tuning.grid.default_grid (the batches its
make_batch draws: jittered lengths, random pages). Each variant is one layer's `write_kv` + attention
(the pool's write_kv for the split variants, which read the new K/V from the layer's inputs):
  flashinfer      pool, FlashInfer paged prefill over each request's whole list, causal
  flash_attn      pool, FlashAttention-4 paged (flash_attn_varlen_func with a page table), causal
  split_fi        FlashInfer ragged prefill over the new tokens (causal) + FlashInfer paged prefill
                  over each request's cached prefix (non-causal, its fa3 kernels), merged by LSE
                  (flashinfer.merge_state_in_place)
  split_fa4       the same ragged level + FlashAttention-4 paged over the cached prefix (non-causal,
                  return_lse, natural log: converted to base 2 for the merge)
  split_fi_kind   (mixed only) split_fi with the decode rows' prefix level on FlashInfer's decode
                  kernel and the chunks' on its prefill kernel (rows stay contiguous: chunks first)
Timing: mstar_attn.tuning.timing._Timer, as the backend grid (repetitions queued behind a GPU sleep,
so no launch gaps are timed; L2 flushed before each), ROUNDS rounds of REPS, variants interleaved;
median of round medians, spread = (max - min) / median of the rounds. Every variant's output is first
checked against the float32 reference per request (norm-relative < 2e-2).
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch

from mstar_attn import kernels
from mstar_attn.cache import PagedKVCache
from mstar_attn.capture.limits import PoolLimits
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from mstar_attn.metadata.plan import build_plan
from mstar_attn.metadata.spec import AttentionSpec
from mstar_attn.tuning.grid import FLUSH_BYTES, default_grid, make_batch
from mstar_attn.tuning.timing import _Timer

ROUNDS, REPS, TOL = 3, 20, 2e-2
LOG2E = 1.4426950408889634
dev = torch.device("cuda")
i32 = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32)


def split_variants(batch, spec, q, k, v, cache, write):
    """The split path's callables over one batch: name -> fn() returning [T, hq, d]."""
    import flashinfer
    from flash_attn.cute import flash_attn_varlen_func

    hq, hk, d, ps = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
    ql, kl = batch.q_lens.astype(np.int64), batch.kv_lens.astype(np.int64)
    prefix = kl - ql
    n_pre = -(-prefix // ps)
    qo = np.concatenate([[0], np.cumsum(ql)])
    lists = [batch.page_indices[batch.page_indptr[i]:batch.page_indptr[i] + n_pre[i]] for i in range(len(ql))]
    pptr = np.concatenate([[0], np.cumsum(n_pre)])
    plast = prefix - (n_pre - 1) * ps
    ws = [torch.empty(256 << 20, dtype=torch.uint8, device=dev) for _ in range(4)]  # one per wrapper
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws[0], "NHD")
    ragged.plan(i32(qo), i32(qo), hq, hk, d, causal=True, q_data_type=q.dtype)

    def paged_prefix(rows, w):
        sub_ptr = pptr[rows.start:rows.stop + 1] - pptr[rows.start]
        sub_idx = np.concatenate(lists[rows])
        sub_qo = qo[rows.start:rows.stop + 1] - qo[rows.start]
        pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(w, "NHD")
        pre.plan(i32(sub_qo), i32(sub_ptr), i32(sub_idx), i32(plast[rows]), hq, hk, d, ps, causal=False,
                 q_data_type=q.dtype)
        return pre

    pre_all = paged_prefix(slice(0, len(ql)), ws[1])
    table = torch.zeros(len(ql), int(n_pre.max()), dtype=torch.int32)
    for i, lst in enumerate(lists):
        table[i, : len(lst)] = i32(lst)
    table, seq, cu = table.to(dev), i32(prefix).to(dev), i32(qo).to(dev)

    def split_fi():
        write()
        o1, l1 = ragged.run(q, k, v, return_lse=True)
        o2, l2 = pre_all.run(q, (cache.k, cache.v), return_lse=True)
        flashinfer.merge_state_in_place(o1, l1, o2, l2)
        return o1

    def split_fa4():
        write()
        o1, l1 = ragged.run(q, k, v, return_lse=True)
        o2, l2 = flash_attn_varlen_func(q, cache.k, cache.v, cu_seqlens_q=cu, seqused_k=seq, page_table=table,
                                        causal=False, softmax_scale=d**-0.5, max_seqlen_q=int(ql.max()),
                                        num_splits=1, return_lse=True)
        flashinfer.merge_state_in_place(o1, l1, o2.contiguous(), (l2 * LOG2E).t().contiguous())
        return o1

    out = {"split_fi": split_fi, "split_fa4": split_fa4}
    chunks = int((ql > 1).sum())
    if chunks < len(ql) and (ql[:chunks] > 1).all():  # mixed: chunks first, then decodes
        pre_chunks = paged_prefix(slice(0, chunks), ws[3])
        dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws[2], "NHD", use_tensor_cores=True)
        dec.plan(i32(pptr[chunks:] - pptr[chunks]), i32(np.concatenate(lists[chunks:])), i32(plast[chunks:]),
                 hq, hk, d, ps, q_data_type=q.dtype)
        tc = int(qo[chunks])

        def split_fi_kind():
            write()
            o1, l1 = ragged.run(q, k, v, return_lse=True)
            oa, la = pre_chunks.run(q[:tc], (cache.k, cache.v), return_lse=True)
            ob, lb = dec.run(q[tc:], (cache.k, cache.v), return_lse=True)
            flashinfer.merge_state_in_place(o1, l1, torch.cat([oa, ob]), torch.cat([la, lb]))
            return o1

        out["split_fi_kind"] = split_fi_kind
    return out


def per_request_err(out, ref, qo):
    e = []
    for i in range(len(qo) - 1):
        a, r = out[qo[i]:qo[i + 1]].float(), ref[qo[i]:qo[i + 1]]
        e.append(((a - r).norm() / r.norm()).item())
    return max(e)


def case(shape, seed, timer):
    hq, hk, d, ps, _ = shape.group
    num_pages = 1 + shape.max_pages + 8
    kw = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, num_pages=num_pages, dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape5 = (num_pages + 1, ps, hk, d)
    cache = PagedKVCache(torch.randn(shape5, device=dev, dtype=torch.bfloat16, generator=gen),
                         torch.randn(shape5, device=dev, dtype=torch.bfloat16, generator=gen), finite=True)
    batch = make_batch(shape, num_pages, seed)
    plan0 = build_plan(batch, AttentionSpec(**kw, backend="reference"))
    T = plan0.num_tokens
    q, k, v = (torch.randn(T, h, d, device=dev, dtype=torch.bfloat16, generator=gen) for h in (hq, hk, hk))
    reference.write_kv(plan0, k, v, cache)
    ref = reference.run(plan0, q.float(), cache)
    qo = np.concatenate([[0], np.cumsum(batch.q_lens)])
    limits = PoolLimits(max_batch_size=256, max_num_tokens=shape.max_tokens, max_num_pages=num_pages,
                        max_pages_per_request=shape.max_pages_per_request)
    fns, pools = {}, []
    for name in ("flashinfer", "flash_attn"):
        spec = AttentionSpec(**kw, backend=name)
        pool = GraphBufferPool(spec, limits, device=dev)
        pools.append(pool)
        step = pool.commit(build_plan(batch, spec))
        fns[name] = (lambda s=step: (kernels.write_kv(s, k, v, cache), kernels.run(s, q, cache, 0, k, v))[1])
    fi_spec = AttentionSpec(**kw, backend="flashinfer")
    pools.append(GraphBufferPool(fi_spec, limits, device=dev))  # the split variants' write_kv: a pool of its own
    write_step = pools[-1].commit(build_plan(batch, fi_spec))
    fns.update(split_variants(batch, AttentionSpec(**kw), q, k, v, cache,
                              lambda: kernels.write_kv(write_step, k, v, cache)))
    rec = {"name": shape.name, "seed": seed, "tokens": T, "requests": len(batch.q_lens), "variants": {}}
    live = {}
    for name, fn in fns.items():
        out = fn()
        torch.cuda.synchronize()
        err = per_request_err(out[:T], ref, qo)
        rec["variants"][name] = {"worst_request_err": err}
        if err < TOL:
            live[name] = fn
        else:
            rec["variants"][name]["status"] = f"mismatch {err:.2e}"
    rounds = {n: [] for n in live}
    queued = {n: [] for n in live}
    names = list(live)
    for r in range(ROUNDS):
        for n in names[r % len(names):] + names[: r % len(names)]:
            xs, qd = timer.round(live[n], REPS, 400.0)
            rounds[n].append(statistics.median(xs))
            queued[n].append(qd)
    for n, rs in rounds.items():
        m = statistics.median(rs)
        rec["variants"][n].update(median_us=round(m, 2), spread=round((max(rs) - min(rs)) / m, 4),
                                  rounds_us=[round(x, 2) for x in rs], queued=all(queued[n]))
    return rec


def main(path: str) -> None:
    import flashinfer

    timer = _Timer(FLUSH_BYTES)
    shapes = [s for s in default_grid() if s.kind in ("extend", "mixed")]
    rows = []
    for i, s in enumerate(shapes):
        rec = case(s, 1000 + i, timer)
        rows.append(rec)
        print(json.dumps({"name": rec["name"], **{n: (v.get("median_us"), round(v["worst_request_err"], 4))
                                                  for n, v in rec["variants"].items()}}), flush=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__,
                "rounds": ROUNDS, "reps": REPS}
        json.dump({"meta": meta, "shapes": rows}, open(path, "w"), indent=1)
        torch.cuda.empty_cache()


PATHS = ("flashinfer", "flash_attn")  # what the dispatcher picks between for extend and mixed steps


def render(data: dict) -> str:
    """The Markdown table of a run: µs per variant (x: over the faster of the two dispatcher paths)."""
    names = ["flashinfer", "flash_attn", "split_fi", "split_fa4", "split_fi_kind"]
    m = data["meta"]
    lines = [f"| shape | {' | '.join(names)} | best split / best path |", "|---|" + "---:|" * (len(names) + 1)]
    for s in data["shapes"]:
        v = s["variants"]
        timed = {n: x for n, x in v.items() if "median_us" in x}  # a variant off the reference is not timed
        best = min(timed[n]["median_us"] for n in PATHS if n in timed)
        cells = []
        for n in names:
            if n not in timed:
                cells.append(v[n].get("status", "·") if n in v else "·")
                continue
            mark = "" if v[n].get("queued", True) else "†"
            cells.append(f"{v[n]['median_us']:.1f}{mark} x{v[n]['median_us'] / best:.2f}")
        split = min(timed[n]["median_us"] for n in timed if n.startswith("split"))
        lines.append(f"| {s['name']} | {' | '.join(cells)} | {split / best:.2f}x |")
    errs = max(x["worst_request_err"] for s in data["shapes"] for x in s["variants"].values() if "median_us" in x)
    return (f"# Split extend path vs the paged paths, {m['device']}\n\n"
            f"torch {m['torch']}, flashinfer {m['flashinfer']}; benchmarks/split_extend_grid.py ({m['rounds']} rounds x "
            f"{m['reps']} repetitions, interleaved, L2 flushed, queued behind a GPU sleep). One layer: write_kv + attention, "
            f"µs (median of round medians), x: over the faster of flashinfer and flash_attn paged (the dispatcher's two "
            f"paths for these steps). Every output within {errs:.1e} of the float32 reference per request "
            f"(norm-relative). †: a round whose host enqueue outlasted the GPU sleep (launch gaps may be timed: an "
            f"upper bound).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--md":
        open(sys.argv[3], "w").write(render(json.load(open(sys.argv[2]))))
    else:
        main(sys.argv[1])
