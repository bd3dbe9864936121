"""Command line: `python -m mstar_attn demo|bench` (also installed as `mstar-attn`)."""

from __future__ import annotations

import argparse
import sys

import torch

from mstar_attn.kernels import BACKENDS
from mstar_attn.metadata.spec import PlanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar-attn", description="mstar_attn: paged attention for LLM inference engines")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a small random Llama through mstar_attn and check it against transformers")
    d.add_argument("--backend", choices=sorted(BACKENDS), default=None, help="default: flashinfer with CUDA, else reference")
    d.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=False, help="replay steps as CUDA graphs (default: off)")
    d.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    d.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, else float32")
    d.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    d.add_argument("--hidden", type=int, default=256, help="hidden size, 8 query heads of hidden/8 dims (default: 256)")
    d.add_argument("--requests", type=int, default=8, help="requests in the trace (default: 8)")
    d.add_argument("--page-size", type=int, default=4, help="tokens per KV page (default: 4)")
    d.add_argument("--seed", type=int, default=0, help="seeds the weights and the trace (default: 0)")
    sub.add_parser("bench", help="per-shape GPU microbenchmark of the backends (needs CUDA)")
    return p


def demo(args: argparse.Namespace) -> int:
    from mstar_attn.demo import DemoConfig, DemoError, run_demo

    cfg = DemoConfig(backend=args.backend, graphs=args.graphs, device=args.device, dtype=args.dtype, layers=args.layers,
                     hidden=args.hidden, requests=args.requests, page_size=args.page_size, seed=args.seed)
    try:
        result = run_demo(cfg, out=sys.stdout)
    except (DemoError, PlanError) as e:
        print(f"mstar-attn demo: {e}", file=sys.stderr)
        return 2
    return 0 if result.matched else 1


def bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("mstar-attn bench: the per-shape GPU microbenchmark needs a CUDA device, and none is visible here.",
              file=sys.stderr)
    else:
        print("mstar-attn bench: the per-shape GPU microbenchmark is not included in this version of mstar_attn.",
              file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"demo": demo, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
