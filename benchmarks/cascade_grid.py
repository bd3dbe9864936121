"""H100: shared-prefix (cascade) decode vs flat paged decode through the pool, side by side in one run.

Grid: B = 8..256 requests in F prefix families (each family shares a prefix of `shared` tokens,
whole pages listed by the same ids; each request has `suffix` tokens of its own, the last partly
on a page of its own), GQA 4 and 8 (32/8 and 64/8 heads, d 128, page 16, bf16). For each shape one
layer's decode step is replayed from captured graphs (DecodeGraphs) in two pools over one cache:
spec.cascade "always" (the cascade path) and "off" (FlashInfer paged decode). The L2 is flushed
before every replay by *reading* 256 MiB (a write-based flush leaves dirty lines whose write-back
lands in the timed kernel), CUDA-event medians of 15 replays per round, 3 interleaved rounds,
median of rounds; spread = (max - min) / median over the rounds. Outputs of the two paths are
compared per request (max norm-relative difference). Host: plan + commit of one step (median of
20), each path. Run on the GPU: python -m benchmarks.cascade_grid OUT_DIR [--heldout [--set=N]] (writes
cascade_grid.json, or cascade_grid_heldout[N].json over heldout_shapes())
then here: python -m benchmarks.cascade_report IN.json OUT_DIR (the Markdown, with the cost model's picks).
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch

from mstar_attn import AttentionSpec, PagedKVCache, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.graphs import DecodeGraphs
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.metadata.batch import DEFAULT_BUCKETS
from mstar_attn.tuning import event_median_us, host_median_us

PS, KVH, D = 16, 8, 128
BUCKETS = DEFAULT_BUCKETS  # the pool's default: the cost model assumes a step padded to these


def shapes() -> list[dict]:
    out = []
    for gqa in (4, 8):
        for B in (8, 32, 64, 128, 256):
            for shared in (512, 2048, 8192, 16384):
                for suffix in (64, 256, 2048):
                    out.append(dict(gqa=gqa, B=B, families=1, shared=shared, suffix=suffix))
        for B, F, shared, suffix in ((64, 4, 8192, 256), (256, 8, 4096, 256), (32, 4, 2048, 64), (128, 16, 1024, 256),
                                     (64, 8, 16384, 2048)):
            out.append(dict(gqa=gqa, B=B, families=F, shared=shared, suffix=suffix))
    return out


def heldout_shapes(only: tuple[int, ...] = ()) -> list[dict]:
    """Shapes off the fitted grid (other batch sizes, most padded to a bucket, prefix and suffix
    lengths, families), each request's own tokens drawn from [suffix / 2, 3 suffix / 2] (`jitter`):
    the cost model's out-of-sample check (written to cascade_grid_heldout.json). The constants are
    fitted on the grid alone; sets 1 and 2 were measured while the model's form was being found (its
    FlashInfer partition terms came from their misses); set 3 was measured once, after the model was
    final (a blind check)."""
    out = []
    sets = (((16, 48, 96, 192), (1024, 4096, 12288), (128, 1024),
             ((96, 3, 6144, 512), (192, 6, 3072, 128), (48, 2, 12288, 1024), (16, 2, 4096, 128), (24, 1, 6144, 384))),
            ((12, 20, 40, 80, 160, 224), (1536, 3072, 10240), (96, 512, 1536),
             ((80, 5, 3072, 256), (160, 10, 1536, 96), (40, 4, 10240, 512), (224, 2, 6144, 1024), (12, 3, 10240, 96))),
            ((10, 28, 56, 112, 200), (768, 2560, 6144, 14336), (80, 320, 1280),
             ((56, 7, 6144, 320), (112, 4, 2560, 80), (200, 8, 14336, 1280), (28, 2, 768, 320), (10, 5, 6144, 80))))
    for n, (batches, prefixes, suffixes, families) in enumerate(sets, 1):
        if only and n not in only:
            continue
        for gqa in (4, 8):
            for B in batches:
                for shared in prefixes:
                    for suffix in suffixes:
                        out.append(dict(set=n, gqa=gqa, B=B, families=1, shared=shared, suffix=suffix, jitter=True))
            for B, F, shared, suffix in families:
                out.append(dict(set=n, gqa=gqa, B=B, families=F, shared=shared, suffix=suffix, jitter=True))
    return out


def batch_of(s: dict, seed: int) -> tuple[StepBatch, int]:
    """The shape's decode batch (family f's members list the same shared pages, then their own) and
    the pages it uses."""
    rng = np.random.default_rng(seed)
    B, F, shared, suffix = s["B"], s["families"], s["shared"], s["suffix"]
    sp = shared // PS
    suffixes = rng.integers(suffix // 2, suffix * 3 // 2 + 1, B) if s.get("jitter") else np.full(B, suffix)
    own = -(-(shared % PS + suffixes) // PS)  # the prefix's partial page (if any) belongs to each request
    ends = F * sp + np.concatenate([[0], np.cumsum(own)])
    ids = rng.permutation(int(ends[-1])).astype(np.int32)
    lists = [np.concatenate([ids[(i % F) * sp : (i % F + 1) * sp], ids[ends[i] : ends[i + 1]]]) for i in range(B)]
    kv = (shared + suffixes).astype(np.int32)
    return StepBatch.from_pages(np.ones(B, np.int32), kv, lists, PS), int(ends[-1])


def main(out_dir: str, heldout: bool = False, only: tuple[int, ...] = ()) -> None:
    from mstar_attn.kernels import flashinfer as fi

    flush = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device="cuda")
    rows = []
    for gqa in (4, 8):
        todo = [s for s in (heldout_shapes(only) if heldout else shapes()) if s["gqa"] == gqa]
        pages = max(batch_of(s, s["B"] * 7 + s["shared"])[1] for s in todo) + 8  # the seeds timed below
        listed = max(s["B"] * (-(-(s["shared"] + s["suffix"] * 3 // 2) // PS) + 1) for s in todo)  # page entries one step lists
        specs = {c: AttentionSpec(KVH * gqa, KVH, D, PS, pages, cascade=c) for c in ("always", "off")}
        cache = PagedKVCache.allocate(specs["off"], "cuda")
        gen = torch.Generator(device="cuda").manual_seed(gqa)
        for t in (cache.k, cache.v):
            for a in range(0, t.shape[0], 4096):
                t[a : a + 4096].copy_(torch.randn(t[a : a + 4096].shape, generator=gen, device="cuda").bfloat16())
        q_all = torch.randn(256, KVH * gqa, D, generator=gen, device="cuda").bfloat16()
        pools, graphs = {}, {}

        def attend(step, x, cache=cache):
            step.mark_stored(cache)  # (the cache is filled by hand: random K/V at every slot)
            return fi.run(step, x["q"], cache)

        for c, spec in specs.items():
            pools[c] = GraphBufferPool(spec, PoolLimits(max_batch_size=256, max_num_tokens=256, max_num_pages=listed,
                                                        buckets=BUCKETS))
            graphs[c] = DecodeGraphs(pools[c], attend, {"q": torch.zeros_like(q_all)})
            graphs[c].capture()
        for s in todo:
            batch, _ = batch_of(s, s["B"] * 7 + s["shared"])
            q = q_all[: s["B"]]
            res, outs = {}, {}
            steps = {}
            for c in specs:
                plan = build_plan(batch, specs[c])
                assert (plan.cascade is not None) == (c == "always"), s
                step = steps[c] = pools[c].commit(plan)
                outs[c] = graphs[c](step, q=q).clone()
                assert graphs[c].serves(step), s
                res[c + "_host_us"] = host_median_us(lambda: pools[c].commit(build_plan(batch, specs[c])), 20, warmup=0)
                torch.cuda.synchronize()
                steps[c] = pools[c].commit(plan)
                graphs[c](steps[c], q=q)
            rounds = {c: [] for c in specs}
            for _ in range(3):
                for c in specs:
                    g = graphs[c].graph_for(steps[c])
                    rounds[c].append(event_median_us(g.replay, 15, before=flush.sum))  # (a read: no dirty lines)
            for c, name in (("always", "cascade"), ("off", "flat")):
                med = statistics.median(rounds[c])
                res[name + "_us"] = med
                res[name + "_spread"] = (max(rounds[c]) - min(rounds[c])) / med
            a, b = outs["always"].float(), outs["off"].float()
            res["max_rel_diff"] = ((a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)).max().item()
            res["speedup"] = res["flat_us"] / res["cascade_us"]
            row = {**s, **res}
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del pools, graphs, cache, attend
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "page_size": PS, "kv_heads": KVH,
            "head_dim": D, "dtype": "bfloat16"}
    name = "_heldout" + "".join(map(str, only)) if heldout else ""
    with open(f"{out_dir}/cascade_grid{name}.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--heldout" in sys.argv[2:], tuple(int(a[6:]) for a in sys.argv[2:] if a.startswith("--set=")))
