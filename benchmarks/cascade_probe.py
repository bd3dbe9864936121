"""Probe (raw FlashInfer, no mstar_attn): can a shared-prefix step run as one CUDA graph of
[gather q rows -> paged prefill over each group's shared pages (graph mode, groups padded with
empty ones) -> decode over each request's suffix -> masked LSE merge -> scatter back], does it
equal flat decode per request, and how fast is it against flat decode? Writes JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import flashinfer
import torch

torch.manual_seed(0)
dev = torch.device("cuda")
H, HK, D, PS = 32, 8, 128, 16


def bench(fn, iters=30):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return g, out, ts[len(ts) // 2], ts


def case(B, shared_tokens, suffix, groups, loners=0, gqa=4, backend="auto"):
    hk = HK
    h = hk * gqa
    shared_pages = shared_tokens // PS
    suf_pages = -(-(suffix) // PS)
    n_pages = groups * shared_pages + B * suf_pages + 1
    scratch = n_pages - 1
    k = torch.randn(n_pages, PS, hk, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n_pages, PS, hk, D, device=dev, dtype=torch.bfloat16)
    members = B - loners
    group_of = [i % groups if i < members else -1 for i in range(B)]
    lists = []
    for i in range(B):
        own = list(range(groups * shared_pages + i * suf_pages, groups * shared_pages + (i + 1) * suf_pages))
        pre = list(range(group_of[i] * shared_pages, (group_of[i] + 1) * shared_pages)) if group_of[i] >= 0 else \
            list(range(groups * shared_pages + i * suf_pages, groups * shared_pages + i * suf_pages)) 
        lists.append(pre + own if group_of[i] >= 0 else own)
    kv_lens = torch.tensor([len(l) * PS for l in lists], dtype=torch.int32)
    lpl = torch.full((B,), PS, dtype=torch.int32)
    indptr = torch.zeros(B + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([len(l) for l in lists]), 0)
    indices = torch.tensor(sum(lists, []), dtype=torch.int32, device=dev)
    q = torch.randn(B, h, D, device=dev, dtype=torch.bfloat16)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)

    flat = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                         paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices.clone(),
                                                         paged_kv_last_page_len_buffer=lpl.to(dev))
    flat.plan(indptr, indices, lpl, h, hk, D, PS, q_data_type=torch.bfloat16)
    _, o_flat, t_flat, ts_flat = bench(lambda: flat.run(q, (k, v)))

    # level order: members by group, then loners
    order = sorted(range(B), key=lambda i: (group_of[i] < 0, group_of[i], i))
    perm = torch.tensor(order, dtype=torch.int32, device=dev)
    inv = torch.empty_like(perm); inv[perm.long()] = torch.arange(B, dtype=torch.int32, device=dev)
    gfix = B // 2 + 1
    qo = [0]
    for g in range(groups):
        qo.append(qo[-1] + sum(1 for i in range(B) if group_of[i] == g))
    qo += [qo[-1]] * (gfix - 1 - groups) + [B]
    s_lists = [list(range(g * shared_pages, (g + 1) * shared_pages)) for g in range(groups)] + [[scratch]] * (gfix - groups)
    s_indptr = torch.zeros(gfix + 1, dtype=torch.int32)
    s_indptr[1:] = torch.cumsum(torch.tensor([len(l) for l in s_lists]), 0)
    s_idx = torch.tensor(sum(s_lists, []), dtype=torch.int32, device=dev)
    s_lpl = torch.full((gfix,), PS, dtype=torch.int32)
    mask = torch.tensor([group_of[i] >= 0 for i in order], dtype=torch.bool, device=dev)
    qo_t = torch.tensor(qo, dtype=torch.int32)
    ws2 = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    shared = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws2, "NHD", use_cuda_graph=True, backend=backend, qo_indptr_buf=qo_t.to(dev),
                                                            paged_kv_indptr_buf=s_indptr.to(dev), paged_kv_indices_buf=s_idx.clone(),
                                                            paged_kv_last_page_len_buf=s_lpl.to(dev))
    shared.plan(qo_t, s_indptr, s_idx, s_lpl, h, hk, D, PS, causal=False, q_data_type=torch.bfloat16)
    x_lists = [lists[i][(shared_pages if group_of[i] >= 0 else 0):] for i in order]
    x_indptr = torch.zeros(B + 1, dtype=torch.int32)
    x_indptr[1:] = torch.cumsum(torch.tensor([len(l) for l in x_lists]), 0)
    x_idx = torch.tensor(sum(x_lists, []), dtype=torch.int32, device=dev)
    ws3 = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    suf = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws3, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                        paged_kv_indptr_buffer=x_indptr.to(dev), paged_kv_indices_buffer=x_idx.clone(),
                                                        paged_kv_last_page_len_buffer=lpl.to(dev))
    suf.plan(x_indptr, x_idx, lpl, h, hk, D, PS, q_data_type=torch.bfloat16)

    def cascade():
        qp = q.index_select(0, perm)
        o1, l1 = shared.run(qp, (k, v), return_lse=True)
        o2, l2 = suf.run(qp, (k, v), return_lse=True)
        flashinfer.merge_state_in_place(o2, l2, o1, l1, mask=mask)
        return o2.index_select(0, inv)

    _, o_c, t_c, ts_c = bench(cascade)
    qp0 = q.index_select(0, perm)
    t_shared = bench(lambda: shared.run(qp0, (k, v), return_lse=True))[2]
    t_suf = bench(lambda: suf.run(qp0, (k, v), return_lse=True))[2]
    out = {}
    for name, tc, split in (("tc_nosplit", True, False), ("cuda_split", False, True), ("cuda_nosplit", False, False)):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws3, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                                                          paged_kv_indptr_buffer=x_indptr.to(dev), paged_kv_indices_buffer=x_idx.clone(),
                                                          paged_kv_last_page_len_buffer=lpl.to(dev))
        w.plan(x_indptr, x_idx, lpl, h, hk, D, PS, q_data_type=torch.bfloat16, disable_split_kv=not split)
        out["suffix_" + name] = bench(lambda: w.run(qp0, (k, v), return_lse=True))[2]
    # two streams: the shared level beside the suffix level (own float workspace each)
    side = torch.cuda.Stream()
    wn = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws3, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                       paged_kv_indptr_buffer=x_indptr.to(dev), paged_kv_indices_buffer=x_idx.clone(),
                                                       paged_kv_last_page_len_buffer=lpl.to(dev))
    wn.plan(x_indptr, x_idx, lpl, h, hk, D, PS, q_data_type=torch.bfloat16, disable_split_kv=True)

    def two():
        qp = q.index_select(0, perm)
        o1 = torch.empty_like(qp); l1 = torch.empty(qp.shape[:2], dtype=torch.float32, device=dev)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared.run(qp, (k, v), out=o1, lse=l1)
        o2, l2 = wn.run(qp, (k, v), return_lse=True)
        main.wait_stream(side)
        flashinfer.merge_state_in_place(o2, l2, o1, l1, mask=mask)
        return o2.index_select(0, inv)
    g2, o_two, t_two, _ = bench(two)
    out["two_streams_us"] = t_two
    out["two_err"] = ((o_two.float() - o_flat.float()).flatten(1).norm(dim=1) / o_flat.float().flatten(1).norm(dim=1)).max().item()
    err = ((o_c.float() - o_flat.float()).flatten(1).norm(dim=1) / o_flat.float().flatten(1).norm(dim=1)).max().item()
    return dict(B=B, shared=shared_tokens, suffix=suffix, groups=groups, loners=loners, gqa=gqa, flat_us=t_flat,
                cascade_us=t_c, speedup=t_flat / t_c, worst_rel_err=err, backend=shared._backend, shared_us=t_shared, suffix_us=t_suf, **out,
                flat_spread=[ts_flat[0], ts_flat[-1]], cascade_spread=[ts_c[0], ts_c[-1]])


rows = []
for args in [(64, 8192, 256, 1, 0, 4, "fa2"), (8, 512, 64, 1, 0, 4, "fa2"), (64, 2048, 2048, 1, 0, 4, "fa2"),
             (256, 16384, 256, 1, 0, 4, "fa2"), (64, 8192, 256, 1, 0, 8, "fa2"), (32, 4096, 64, 4, 4, 4, "fa2")]:
    r = case(*args)
    rows.append(r)
    print(json.dumps({k: (round(v, 4 if "err" in k else 1) if isinstance(v, float) else v) for k, v in r.items() if "spread" not in k}), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
