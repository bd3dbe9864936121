"""Part (a) of host_step at the given batch sizes, with the planner's SHORT_CHECK (the request count up to which
the StepRows decode checks and Ranges.holds run on Python lists; past it, the compiled builder's loops) set for this
process. Run one process per setting, alternating, on the GPU machine:
    python -m benchmarks.short_check_ab OUT SHORT_CHECK B[,B...]     (prints one line per batch; writes
    OUT/short_check_<SHORT_CHECK>_<pid>.json, part (a)'s rows)"""

from __future__ import annotations

import json
import os
import sys

import torch

from mstar_attn.metadata import _arrays, plan as plan_module


def main(out_dir: str, short: int, batches: tuple[int, ...]) -> None:
    _arrays.SHORT_CHECK = plan_module.SHORT_CHECK = short  # (before any pool or Ranges is made: they read it then)
    from benchmarks import cases
    from benchmarks.host_step import PS, part_a
    from mstar_attn import AttentionSpec
    from mstar_attn.capture.pool import FLOAT_WORKSPACE_BYTES

    ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = part_a(AttentionSpec(32, 8, 128, PS, cases.NUM_PAGES), ws, batches)
    for r in rows:
        print("SHORT", short, r["batch"], round(r["ratio"], 3), round(r["paired_ratio"], 3), round(r["rows_step_us"], 1),
              round(r["flashinfer_plan_us"], 1), round(r["batch_ratio"], 3), flush=True)
    with open(f"{out_dir}/short_check_{short}_{os.getpid()}.json", "w") as f:
        json.dump({"short_check": short, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), tuple(int(b) for b in sys.argv[3].split(",")))
