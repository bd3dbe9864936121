"""Device and pinned host memory of a GraphBufferPool and its captured decode graphs (GPU).

The configuration of the report this answers: 32/8 heads, head dim 128, page 16, bf16, buckets
1..256, q_lens (1, 4) captured, FlashInfer, one or two layer groups (full + a 4096-token window).
Each measurement runs in a fresh process, so one never inherits another's cached blocks:

    python -m benchmarks.pool_memory measure --groups 2 [--tag new]   # prints one JSON line
    python -m benchmarks.pool_memory report OUT_DIR LINES.jsonl       # pool_memory_h100.json / .md

It imports whatever `mstar_attn` comes first on PYTHONPATH, so the same script measures an older
tree (`git archive <commit> mstar_attn | tar -x -C DIR`, then PYTHONPATH=DIR) beside this one, in
one run on one machine. What is counted: torch's device allocator (memory_allocated, i.e. what
the pool, FlashInfer's wrappers and the graphs' memory pool hold) and torch's pinned host
allocator (host_memory_stats), each as the difference from just before the pool was made; the
KV cache and the graphs' static inputs are allocated before that baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

NUM_PAGES = 40000
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def pinned_owned(stats: dict) -> int:
    """Pinned host bytes torch's host allocator owns (live and cached blocks), from host_memory_stats():
    "allocated_bytes.current" (torch 2.11 never decrements its "active_bytes"; seen on the H100 image)."""
    return int(stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0)))


def _pinned() -> dict:
    import torch

    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {k: v for k, v in stats.items() if k.endswith(".current") and "bytes" in k}


def _snapshot() -> dict:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free, "pinned": _pinned()}


def _delta(a: dict, b: dict) -> dict:
    out = {k: b[k] - a[k] for k in ("allocated", "reserved", "device_used")}
    out["pinned"] = {k: b["pinned"].get(k, 0) - a["pinned"].get(k, 0) for k in b["pinned"]}
    return out


def measure(groups: int, tag: str) -> dict:
    import numpy as np
    import torch

    import mstar_attn
    from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, StepBatch, build_plan
    from mstar_attn.capture.graphs import DecodeGraphs
    from mstar_attn.capture.pool import GraphBufferPool
    from mstar_attn import PoolLimits
    from mstar_attn.kernels import flashinfer as fi

    layer_groups = (LayerGroup(), LayerGroup("window", window=4096))[:groups]
    spec = AttentionSpec(32, 8, 128, 16, NUM_PAGES, groups=layer_groups)
    cache = PagedKVCache.allocate(spec, "cuda")
    static = torch.zeros(256 * 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    base = _snapshot()
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=8192, max_num_pages=NUM_PAGES,
                                            buckets=BUCKETS))
    after_pool = _snapshot()

    def attend(step, x):
        if hasattr(step, "mark_stored"):  # (what the cache holds does not matter here; older trees have no mark_stored)
            step.mark_stored(cache)
        return torch.stack([fi.run(step, x["q"], cache, group=g) for g in range(groups)])

    graphs = DecodeGraphs(pool, attend, {"q": static})
    t0 = time.perf_counter()
    graphs.capture(q_lens=(1, 4))
    capture_s = time.perf_counter() - t0
    after_capture = _snapshot()
    sched = pool.backend_state("flashinfer")
    out = {"tag": tag, "groups": groups, "mstar_attn": getattr(mstar_attn, "__version__", "?"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "capture_s": round(capture_s, 1),
           "graphs": len(graphs.graphs), "wrappers": len(getattr(sched, "wrappers", {})),
           "pool": _delta(base, after_pool), "capture": _delta(after_pool, after_capture), "total": _delta(base, after_capture)}
    if hasattr(pool, "memory_report"):
        out["memory_report"] = {k: list(v) for k, v in pool.memory_report().components.items()}
    rng = np.random.default_rng(0)
    for B in (1, 256):  # host-to-device bytes of one decode commit, where the pool counts them
        kv = rng.integers(1800, 2300, B).astype(np.int32)
        need = (kv + 15) // 16
        indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
        plan = build_plan(StepBatch.from_csr(np.ones(B, np.int32), kv, indptr,
                                             rng.permutation(NUM_PAGES)[: indptr[-1]].astype(np.int32), 16), spec)
        step = pool.commit(plan)
        graphs(step, q=torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16))
        if hasattr(pool, "last_commit_bytes"):
            pages = sum(int(gp.kv_indices.shape[0]) for gp in plan.groups)
            out[f"decode_commit_bytes_B{B}"] = {"bytes": pool.last_commit_bytes, "pages_read": pages,
                                               "bytes_besides_pages": pool.last_commit_bytes - 4 * pages}
    torch.cuda.synchronize()
    return out


def _mib(x: int) -> str:
    return f"{x / 2**20:.1f}"


def _pinned_bytes(d: dict) -> int:
    return pinned_owned(d["pinned"])


def report(out_dir: str, lines_path: str) -> None:
    rows = [json.loads(line) for line in open(lines_path) if line.startswith("{")]
    json.dump(rows, open(f"{out_dir}/pool_memory_h100.json", "w"), indent=1)
    md = [f"# Pool and decode-graph memory on {rows[0]['device']} (torch {rows[0]['torch']})", "",
          "32/8 heads, head dim 128, page 16, bf16, FlashInfer; buckets 1..256, q_lens (1, 4) captured, both pool slots;"
          " fresh process per row; MiB over the baseline taken after the KV cache and the graphs' static input existed. "
          "device = torch's device allocator (memory_allocated), pinned = torch's pinned host allocator (allocated).", "",
          "| tree | groups | wrappers | graphs | pool device | pool pinned | capture device | capture pinned | "
          "**total device + pinned** | capture s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    totals = {}
    for r in rows:
        tot = r["total"]["allocated"] + _pinned_bytes(r["total"])
        totals[(r["tag"], r["groups"])] = tot
        md.append(f"| {r['tag']} ({r['mstar_attn']}) | {r['groups']} | {r['wrappers']} | {r['graphs']} | "
                  f"{_mib(r['pool']['allocated'])} | {_mib(_pinned_bytes(r['pool']))} | {_mib(r['capture']['allocated'])} | "
                  f"{_mib(_pinned_bytes(r['capture']))} | **{_mib(tot)}** | {r['capture_s']} |")
    md.append("")
    for groups in (1, 2):
        if ("old", groups) in totals and ("new", groups) in totals:
            md.append(f"- {groups} group(s): new / old = {totals[('new', groups)] / totals[('old', groups)]:.3f} "
                      f"({_mib(totals[('new', groups)])} vs {_mib(totals[('old', groups)])} MiB)")
    for r in rows:
        if "memory_report" in r:
            md += ["", f"### pool.memory_report(), {r['tag']}, {r['groups']} group(s)", "", "| component | device MiB | pinned MiB |",
                   "|---|---:|---:|"] + [f"| {k} | {_mib(d)} | {_mib(p)} |" for k, (d, p) in r["memory_report"].items()]
        for B in (1, 256):
            c = r.get(f"decode_commit_bytes_B{B}")
            if c:
                md.append(f"\nDecode commit, B = {B} ({r['tag']}, {r['groups']} group(s)): {c['bytes']} bytes host-to-device "
                          f"by the pool's counter = 4 x {c['pages_read']} pages read + {c['bytes_besides_pages']} bytes of O(B) arrays.")
    open(f"{out_dir}/pool_memory_h100.md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pool_memory")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--groups", type=int, choices=(1, 2), default=2)
    m.add_argument("--tag", default="new")
    r = sub.add_parser("report")
    r.add_argument("out_dir")
    r.add_argument("lines")
    args = p.parse_args(argv)
    if args.cmd == "measure":
        print(json.dumps(measure(args.groups, args.tag)))
    else:
        report(args.out_dir, args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
