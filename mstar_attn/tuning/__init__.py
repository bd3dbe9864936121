"""Per-shape GPU microbenchmark of the attention backends, and the measured dispatch table.

Modules: grid (the shapes), timing (CUDA-event rounds, ceilings), measure (run_grid), table
(derive_table), render (Markdown, PNG), cli (bench_main).

`python -m mstar_attn bench [--out DIR] [--quick] [--write-table] [--plot-only JSON]` (`bench_main`).

What is timed: one layer of one engine step, the KV write and the attention together
(`kernels.write_kv(step, k, v, cache)` then `kernels.run(step, q, cache, 0, k, v)`), through the
dispatching functions, for every backend whose registry entry can serve the step (its modes;
prefix-free backends only for prefill with no cached prefix), on the same batch, cache and
inputs, side by side in one process. A backend whose package is missing is recorded
"unavailable"; one that raises, "error"; one whose output is off the float32 reference by more
than TOL (or not finite), "mismatch". None of those enter the dispatch table.

Method (the workplace's GPU timing method; choices and reasons):
  - Correct first: every backend's output is compared with the reference backend (float32
    arithmetic over the same bf16 cache) on fresh random inputs (never zeros) before timing.
  - Warm-up: the first call of every backend and shape (FlashInfer JIT, FA4 compile) and
    `warmup` more run before any timing; `first_call_s` records the first call.
  - Timing: CUDA events around each repetition, `rounds` rounds of `reps` repetitions per
    backend, backends interleaved round by round (order rotated), median of all repetitions.
    Each round is queued behind a GPU sleep long enough for the host to enqueue every
    repetition first, so the events time the GPU work back to back and not Python launch
    overhead; `queued` records that the host really was ahead (else the round is redone with a
    longer sleep, up to twice). The calls are eager, but a bucketed decode / verify step runs
    the same graph-mode FlashInfer wrappers a captured graph replays.
  - L2: flushed (FLUSH_BYTES written) before every repetition. Decided so because in a model
    step each attention call follows other layers' weights and activations, which evict the
    50 MB L2, so attention starts cold; without a flush the small shapes (a decode step of a
    few MB of KV) would be timed from cache, which serving never sees.
  - Noise: `spread` = (max - min) / median of a backend's per-round medians. The dispatch
    table picks a backend other than FlashInfer paged only when it beats it by more than
    max(margin, both spreads) on every measured shape of the bucket.
  - Two numbers: the device's copy bandwidth (a 1 GiB device copy, read + write) and bf16
    matmul rate (8192^3) are measured once; each shape's floor = max(bytes / bandwidth,
    FLOPs / matmul rate), with bytes = K/V read once + q read + out written + the write_kv
    traffic, FLOPs = 4 * qo_heads * head_dim * sum of causal (query, key) pairs.

Outputs in --out: backend_grid.json (everything, raw samples included, rewritten after every
shape so a cut-off run keeps what it measured), backend_grid.md, backend_table.json (the table
derived from this run), backend_grid.png when matplotlib is importable (the GPU machine may
not have it: `--plot-only backend_grid.json` renders it later anywhere). --write-table also
installs the derived table as the package default (mstar_attn/backend_table.json), which
`select_backend` reads for specs with backend="auto".
"""

from mstar_attn.tuning.cli import DEFAULT_OUT, PACKAGE_TABLE, bench_main
from mstar_attn.tuning.grid import DEFAULT_HEADS, FLUSH_BYTES, GRID_BACKENDS, TOL, Shape, default_grid, make_batch, quick_grid
from mstar_attn.tuning.measure import RESULTS_VERSION, BenchConfig, run_grid
from mstar_attn.tuning.render import RESULTS_KIND, load_results, plot_results, render_markdown, render_table_markdown
from mstar_attn.tuning.table import NOISE_MARGIN, RESULTS_NAME, derive_table, dumps_table, shape_key, write_table
from mstar_attn.tuning.timing import copy_TBps, event_median_us, host_median_us, interleaved_rounds, median_spread

__all__ = [
    "DEFAULT_HEADS", "DEFAULT_OUT", "FLUSH_BYTES", "GRID_BACKENDS", "NOISE_MARGIN", "PACKAGE_TABLE", "RESULTS_KIND",
    "RESULTS_NAME", "RESULTS_VERSION", "TOL", "BenchConfig", "Shape", "bench_main", "copy_TBps", "default_grid",
    "derive_table", "dumps_table", "event_median_us", "host_median_us", "interleaved_rounds", "load_results", "make_batch", "median_spread", "plot_results",
    "quick_grid", "render_markdown", "render_table_markdown", "run_grid", "shape_key", "write_table",
]
