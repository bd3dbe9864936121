"""Command line: `python -m mstar_attn demo|warmup|bench` (also installed as `mstar-attn`)."""

from __future__ import annotations

import argparse
import sys

from mstar_attn.kernels import AUTO, BACKENDS
from mstar_attn.metadata.spec import PlanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar-attn", description="mstar_attn: paged attention for LLM inference engines")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a small random Llama through mstar_attn and check it against transformers")
    d.add_argument("--backend", choices=[*sorted(BACKENDS), AUTO], default=None,
                   help=f"default: flashinfer with CUDA, else reference; {AUTO}: each step's plan picks")
    d.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps as CUDA graphs and time them against eager (default: on for GPU backends)")
    d.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    d.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, else float32")
    d.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    d.add_argument("--hidden", type=int, default=None,
                   help="hidden size, 8 query heads of hidden/8 dims (default: 512 on GPU backends, else 256)")
    d.add_argument("--requests", type=int, default=8, help="requests in the trace (default: 8)")
    d.add_argument("--page-size", type=int, default=4, help="tokens per KV page (default: 4)")
    d.add_argument("--seed", type=int, default=0, help="seeds the weights and the trace (default: 0)")
    d.add_argument("--model", choices=["llama", "gemma2", "bart", "gpt_oss"], default="llama",
                   help="the transformers family (default: llama); gemma2 interleaves sliding-window layers, on "
                        "their own page lists, with full ones; bart is an encoder-decoder (cross attention); "
                        "gpt_oss has attention sinks beside window and full layers")
    d.add_argument("--window", type=int, default=8, help="gemma2's and gpt_oss's sliding window in tokens (default: 8)")
    d.add_argument("--cascade", choices=["off", "auto", "always"], default="off",
                   help="shared-prefix attention: requests sharing a system prompt's pages read them once per step "
                        "(auto: where the cost model says it wins; default: off)")
    d.add_argument("--compile", nargs="?", const="full", default="off", choices=["off", "full", "piecewise"],
                   help="run each step's forward through torch.compile(fullgraph=True), attention as mstar_attn custom "
                        "ops; piecewise: the graph split at attention, the pieces between compiled; prints the graph-break "
                        "count (default: off; --compile alone: full)")
    d.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="speculative decoding: draft rounds of K tokens (one graph each on CUDA), target verify steps")
    d.add_argument("--tree", type=int, default=0, metavar="W",
                   help="with --speculate K: verify a draft tree of W tokens per level (1 + K x W per request; the "
                        "reference backend), and report its acceptance beside the chain's at the same K")
    d.add_argument("--draft", choices=["small", "self"], default="small",
                   help="with --speculate: the target's first half of the layers (default), or the target itself")
    w = sub.add_parser("warmup", help="build every kernel a demo model's steps can reach, with cold and warm times")
    w.add_argument("--model", choices=["llama", "gemma2", "bart", "gpt_oss"], default="llama", help="the demo's model (default: llama)")
    w.add_argument("--backend", choices=[*sorted(BACKENDS), AUTO], default=None,
                   help="default: flashinfer with CUDA, else reference (with --list: flashinfer)")
    w.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 for GPU backends")
    w.add_argument("--hidden", type=int, default=None, help="as the demo's --hidden")
    w.add_argument("--page-size", type=int, default=4, help="tokens per KV page (default: 4)")
    w.add_argument("--window", type=int, default=8, help="gemma2's sliding window (default: 8)")
    w.add_argument("--cascade", choices=["off", "auto", "always"], default="off", help="as the demo's --cascade")
    w.add_argument("--list", action="store_true", help="print what warm-up would run and exit (no GPU, no compiler)")
    sub.add_parser("bench", add_help=False, help="per-shape GPU microbenchmark of the backends (needs CUDA); "
                                                 "its arguments go to mstar_attn.tuning (bench --help)")
    return p


def demo(args: argparse.Namespace) -> int:
    from mstar_attn.demo import DemoConfig, DemoError, run_demo

    cfg = DemoConfig(backend=args.backend, graphs=args.graphs, device=args.device, dtype=args.dtype, layers=args.layers,
                     hidden=args.hidden, requests=args.requests, page_size=args.page_size, seed=args.seed,
                     model=args.model, window=args.window, cascade=args.cascade, compile=args.compile)
    try:
        if args.tree and not args.speculate:
            raise DemoError("--tree W verifies draft trees: give --speculate K too")
        if args.speculate:
            from mstar_attn.demo.report import write
            from mstar_attn.demo.speculate import run_speculative, summary

            result = run_speculative(cfg, args.speculate, args.draft, args.tree)
            write(sys.stdout, summary(result))
            if args.tree:
                chain = run_speculative(cfg, args.speculate, args.draft)
                per = lambda r: r.accepted / max(sum(r.round_sizes), 1)  # noqa: E731  (per request and round)
                write(sys.stdout, f"accepted  {per(result):.2f} draft tokens per request per round with the tree vs "
                                  f"{per(chain):.2f} with the chain at the same K ({result.rounds} vs {chain.rounds} "
                                  f"rounds; chain matches: {'yes' if chain.matched else 'no'})\n")
                result = result if chain.matched else chain
        else:
            result = run_demo(cfg, out=sys.stdout, progress=sys.stderr)
    except (DemoError, PlanError) as e:
        print(f"mstar-attn demo: {e}", file=sys.stderr)
        return 2
    return 0 if result.matched else 1


def warmup(args: argparse.Namespace) -> int:
    """`warmup --list`: the kinds of step warm-up runs for a demo model, with its layer groups, no GPU needed;
    without --list: run them (mstar_attn.warmup) and print each one's cold and warm time."""
    import torch

    from mstar_attn.demo import DemoConfig, DemoError
    from mstar_attn.demo.config import DTYPES
    from mstar_attn.demo.run import FAMILIES, dense_backend, model_spec
    from mstar_attn.warmup import kinds, warmup_model

    backend = args.backend or ("flashinfer" if args.list or torch.cuda.is_available() else "reference")
    gpu = backend != "reference"
    cfg = DemoConfig(backend=backend, device="cpu" if args.list or not gpu else "cuda",
                     dtype=args.dtype or ("bfloat16" if gpu else "float32"), hidden=args.hidden, page_size=args.page_size,
                     model=args.model, window=args.window, cascade=args.cascade).resolve()
    try:
        family = FAMILIES[cfg.model]
        with torch.device("meta"):  # (the config's shapes only: no weights)
            model = family.build_model(cfg, DTYPES[cfg.dtype], torch.device("meta"))
        spec = model_spec(cfg, family, model, 1024, backend)
        todo = kinds(spec)
        groups = ", ".join(f"{g.kind.value}" + (f" {g.window}" if g.window else "") for g in spec.groups)
        print(f"{cfg.model}: {spec.num_qo_heads}/{spec.num_kv_heads} heads, head_dim {spec.head_dim}, {cfg.dtype}, "
              f"page {spec.page_size}, soft_cap {spec.soft_cap}, layer groups: {groups}; {len(todo)} kinds of step")
        if args.list:
            for k in todo:
                print(f"  {k.name}")
            if spec.has_cross:
                print(f"  {dense_backend(backend)} dense (the encoder, non-causal)")
            return 0
        report = warmup_model(spec, dense_backend(backend), device=cfg.device, progress=lambda i, n, t: print(
            f"  [{i}/{n}] {t.kind.name}: {t.cold_s:.2f} s cold, {t.warm_s * 1e3:.2f} ms warm", file=sys.stderr, flush=True))
    except (DemoError, PlanError) as e:
        print(f"mstar-attn warmup: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0


def bench(argv: list[str]) -> int:
    """Forward argv (everything after `bench`) to mstar_attn.tuning.bench_main; its return code is ours."""
    try:
        from mstar_attn.tuning import bench_main
    except ImportError as e:
        print(f"mstar-attn bench: the benchmark (mstar_attn.tuning) cannot be loaded here: {e}", file=sys.stderr)
        return 2
    return int(bench_main(list(argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser, in mstar_attn.tuning: pass every argument through untouched
        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    return warmup(args) if args.command == "warmup" else demo(args)


if __name__ == "__main__":
    sys.exit(main())
