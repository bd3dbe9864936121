"""Probe (raw kernels, no mstar_attn): extend steps (q new tokens after a cached prefix) three ways,
side by side: FlashInfer paged prefill (causal over the whole list), FlashAttention-4 paged
(flash_attn_varlen_func with a page table), and the split path (FlashInfer ragged prefill over the
new tokens alone, causal, + FlashInfer paged prefill over the cached prefix, non-causal, merged by
LSE). Eager calls, CUDA-event medians of 20, L2 flushed by a read. Writes JSON to argv[1]."""

import json
import statistics
import sys

import flashinfer
import torch
from flash_attn.cute import flash_attn_varlen_func

H, HK, D, PS = 32, 8, 128, 16
PREFIX_BACKEND = sys.argv[2] if len(sys.argv) > 2 else "auto"  # the prefix level: "auto" (fa3 on Hopper) or "fa2"
dev = torch.device("cuda")
flush = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device=dev)


def med(fn, n=20):
    ts = []
    for _ in range(n):
        flush.sum()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def case(B, q, prefix):
    g = torch.Generator(device=dev).manual_seed(B * q + prefix)
    n_pre, n_all = prefix // PS, (prefix + q + PS - 1) // PS
    pages = B * n_all + 1
    k = torch.randn(pages, PS, HK, D, generator=g, device=dev).bfloat16()
    v = torch.randn(pages, PS, HK, D, generator=g, device=dev).bfloat16()
    ids = torch.randperm(pages - 1, device=dev, generator=g)[: B * n_all].int().view(B, n_all)
    qt = torch.randn(B * q, H, D, generator=g, device=dev).bfloat16()
    flat = ids.flatten()
    ptr = torch.arange(B + 1, dtype=torch.int32) * n_all
    lpl = torch.full((B,), (prefix + q) - (n_all - 1) * PS, dtype=torch.int32)
    qo = torch.arange(B + 1, dtype=torch.int32) * q
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    paged.plan(qo, ptr, flat, lpl, H, HK, D, PS, causal=True, q_data_type=torch.bfloat16)
    ref = paged.run(qt, (k, v))
    t_paged = med(lambda: paged.run(qt, (k, v)))
    seq = torch.full((B,), prefix + q, dtype=torch.int32, device=dev)
    fa = lambda: flash_attn_varlen_func(qt, k, v, cu_seqlens_q=qo.to(dev), seqused_k=seq, page_table=ids, causal=True,
                                        softmax_scale=D**-0.5, max_seqlen_q=q, num_splits=1)[0]
    o_fa = fa()
    t_fa = med(fa)
    # split: the new tokens' K/V contiguous (as the step has them), the prefix's whole pages paged
    rows = (torch.arange(B, device=dev)[:, None] * 0 + torch.arange(prefix, prefix + q, device=dev)[None])
    page_of = ids.long().gather(1, rows // PS)
    k_new = k[page_of, rows % PS].reshape(B * q, HK, D)
    v_new = v[page_of, rows % PS].reshape(B * q, HK, D)
    ws2 = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws2, "NHD")
    ragged.plan(qo, qo, H, HK, D, causal=True, q_data_type=torch.bfloat16)
    # the prefix: whole pages plus the partial one (its first prefix % PS tokens)
    n_pp = -(-prefix // PS)
    pptr = torch.arange(B + 1, dtype=torch.int32) * n_pp
    plpl = torch.full((B,), prefix - (n_pp - 1) * PS, dtype=torch.int32)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=PREFIX_BACKEND)
    pre.plan(qo, pptr, ids[:, :n_pp].flatten(), plpl, H, HK, D, PS, causal=False, q_data_type=torch.bfloat16)

    def split():
        o1, l1 = ragged.run(qt, k_new, v_new, return_lse=True)
        o2, l2 = pre.run(qt, (k, v), return_lse=True)
        flashinfer.merge_state_in_place(o1, l1, o2, l2)
        return o1
    o_s = split()
    t_split = med(split)
    t_ragged = med(lambda: ragged.run(qt, k_new, v_new, return_lse=True))
    t_pre = med(lambda: pre.run(qt, (k, v), return_lse=True))
    err = lambda o: ((o.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1)).max().item()
    return dict(B=B, q=q, prefix=prefix, fi_paged_us=t_paged, fa4_paged_us=t_fa, split_us=t_split, split_ragged_us=t_ragged,
                split_prefix_us=t_pre, prefix_backend=pre._backend, err_fa4=err(o_fa), err_split=err(o_s))


rows = []
for args in [(8, 256, 2048), (4, 1024, 8192), (16, 128, 4096), (2, 2048, 2048), (32, 64, 1024)]:
    r = case(*args)
    rows.append(r)
    print(json.dumps({k: round(v, 4 if "err" in k else 1) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
