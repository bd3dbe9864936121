"""H100 probe: torch.index_select vs advanced indexing vs gather vs embedding for the cascade row
permutation ([R, heads, 128] bf16 rows, R = 8..256), each op captured 100 times in one CUDA graph,
median of 5 replays, µs per call. Run: python -m benchmarks.perm_probe (results/perm_probe_h100.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OPS = {
    "index_select": lambda x, p: x.index_select(0, p),
    "getitem": lambda x, p: x[p],
    "gather": lambda x, p: torch.gather(x, 0, p.view(-1, 1, 1).expand(-1, x.shape[1], x.shape[2])),
    "embedding": lambda x, p: F.embedding(p, x.view(x.shape[0], -1)).view(-1, x.shape[1], x.shape[2]),
}


def per_call_us(fn, x, perm, calls: int = 100) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up off the capture
        for _ in range(3):
            fn(x, perm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x, perm)
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[2]


def main() -> None:
    for heads in (32, 64):
        for rows in (8, 12, 16, 17, 24, 32, 64, 256):
            x = torch.randn(rows, heads, 128, device="cuda").bfloat16()
            perm = torch.randperm(rows, device="cuda")
            res = {}
            for name, fn in OPS.items():
                assert torch.equal(fn(x, perm), x[perm]), name
                res[name] = round(per_call_us(fn, x, perm), 2)
            print(f"H{heads} R{rows} us/call", res, flush=True)


if __name__ == "__main__":
    main()
