"""`python -m mstar_attn bench ...`: run the grid, write results, the table, the reports."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from mstar_attn.metadata import select
from mstar_attn.tuning.grid import DEFAULT_HEADS, default_grid, quick_grid
from mstar_attn.tuning.measure import _Fatal, run_grid
from mstar_attn.tuning.render import load_results, plot_results, render_markdown, render_table_markdown
from mstar_attn.tuning.table import NOISE_MARGIN, RESULTS_NAME, derive_table, write_table

DEFAULT_OUT = "benchmarks/results"
PACKAGE_TABLE = select.TABLE_PATH  # where --write-table installs the table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mstar-attn bench",
        description="Per-shape GPU microbenchmark of the attention backends (write_kv + run, side by side, medians), "
                    "and the dispatch table that backend='auto' uses.")
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"where results go (default: {DEFAULT_OUT}; with --plot-only: the JSON's folder)")
    p.add_argument("--quick", action="store_true", help="a 3-shape grid for smoke tests")
    p.add_argument("--write-table", action="store_true",
                   help=f"also install the derived dispatch table as the package default ({PACKAGE_TABLE.name})")
    p.add_argument("--plot-only", metavar="JSON", default=None,
                   help="no GPU: re-render the Markdown and the plot from a results JSON (with --write-table, "
                        "also install the table it implies)")
    p.add_argument("--margin", type=float, default=NOISE_MARGIN,
                   help=f"noise margin a backend must beat flashinfer paged by (default: {NOISE_MARGIN})")
    p.add_argument("--heads", type=_heads, default=DEFAULT_HEADS, metavar="QO/KV[,QO/KV...]",
                   help="query/KV head pairs of the grid (default: 32/8,16/2; each new GQA ratio costs FA4 compiles)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of the grid (default: 128)")
    return p


def _heads(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(x) for x in part.split("/")) for part in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) < 1 or p[0] % p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"expected QO/KV pairs like 32/8,16/2 (QO a multiple of KV), got {text!r}")
    return pairs


def _plot(results: Mapping, png: Path, json_path: Path) -> bool:
    try:
        plot_results(results, png)
    except ImportError:
        print(f"mstar-attn bench: matplotlib is not installed here, so no plot; render it later anywhere with "
              f"`python -m mstar_attn bench --plot-only {json_path}`", file=sys.stderr)
        return False
    print(f"wrote {png}")
    return True


def bench_main(argv: list[str]) -> int:
    """`python -m mstar_attn bench ...` (see _parser). 0: done; 1: the run broke (partial results
    kept); 2: bad arguments, no CUDA, or (--plot-only) no matplotlib."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    if args.plot_only:
        return _plot_only(args)
    import torch

    if not torch.cuda.is_available():
        print("mstar-attn bench: the per-shape microbenchmark needs a CUDA GPU, and none is visible here. "
              "(Without a GPU: --plot-only RESULTS.json re-renders a run's Markdown and plot.)", file=sys.stderr)
        return 2
    out = Path(args.out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    shapes = (quick_grid if args.quick else default_grid)(args.heads, args.head_dim)
    json_path = out / f"{RESULTS_NAME}.json"
    code = 0
    try:
        results = run_grid(shapes, out)
    except _Fatal as e:
        print(f"mstar-attn bench: CUDA failed ({e}); the shapes measured before are in {json_path}", file=sys.stderr)
        results, code = load_results(json_path), 1
    table = derive_table(results, args.margin)
    write_table(table, out / "backend_table.json")
    if args.write_table and code == 0:
        print(f"installed the dispatch table: {write_table(table, PACKAGE_TABLE)}")
    (out / f"{RESULTS_NAME}.md").write_text(render_markdown(results, table))
    _plot(results, out / f"{RESULTS_NAME}.png", json_path)
    print(render_table_markdown(table) + "\n")  # the per-shape table last: a cut-off tail still shows it
    print(render_markdown(results))
    print(f"wrote {json_path}, {out / (RESULTS_NAME + '.md')}, {out / 'backend_table.json'} in {results.get('wall_s', '?')} s")
    return code


def _plot_only(args) -> int:
    src = Path(args.plot_only)
    try:
        results = load_results(src)
    except (OSError, ValueError) as e:
        print(f"mstar-attn bench: --plot-only: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    table = derive_table(results, args.margin)
    if args.write_table:
        print(f"installed the dispatch table: {write_table(table, PACKAGE_TABLE)}")
    md_path = out / f"{src.stem}.md"
    md_path.write_text(render_markdown(results, table))
    print(f"wrote {md_path}")
    return 0 if _plot(results, out / f"{src.stem}.png", src) else 2
