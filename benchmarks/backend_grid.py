"""The per-shape backend grid on the GPU, written where the lead collects results.

    python -m benchmarks.backend_grid OUT_DIR [--quick] [--write-table]

is `python -m mstar_attn bench --out OUT_DIR ...` (mstar_attn.tuning.bench_main): writes
OUT_DIR/backend_grid.json, .md, backend_table.json (and .png where matplotlib is installed).
"""

from __future__ import annotations

import sys

from mstar_attn.tuning import DEFAULT_OUT, bench_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    out = argv[0] if argv and not argv[0].startswith("-") else DEFAULT_OUT
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    return bench_main(["--out", out, *rest])


if __name__ == "__main__":
    sys.exit(main())
