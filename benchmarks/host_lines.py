"""GPU host: line-level host µs of the StepRows decode step (a diagnosis aid beside host_profile.py, no targets).

Per B = 1, 8, 64: the part (a) engine of host_step (pages given up front, a one-layer decode graph run
untimed after each step), its steps run under line_profiler over the functions of the per-step path.
line_profiler is not a dependency: the device carries it (PYTHONPATH). Totals include the profiler's
own cost per line (~0.1-0.3 µs); read the shares, not the absolute µs.
With --lists: the StepBatch path instead (host_step's ListEngine over the same requests: StepBatch.from_csr +
build_plan + commit, its step run by the decode graph; writes host_lines_lists_<device>.txt).
With --demo MODEL: the demo (python -m mstar_attn demo --model MODEL) under line_profiler over its commit and
build_plan paths instead (writes host_lines_demo_MODEL_<device>.txt).
Run on the GPU: python -m benchmarks.host_lines OUT_DIR [--demo MODEL]   (writes host_lines_<device>.txt, device: cases.device_tag)
"""

from __future__ import annotations

import io
import sys

import torch
from line_profiler import LineProfiler

from benchmarks import cases
from benchmarks.host_step import PS, Engine, list_pool, one_layer, table_pool
from mstar_attn import AttentionSpec, PagedKVCache
from mstar_attn.capture import checks, graph_cache, lease, pool, stage, steady, table
from mstar_attn.kernels import _flashinfer_fast, flashinfer as fi
from mstar_attn.metadata import _arrays, batch, listed, native, plan, record


def functions() -> list:
    """The functions a StepRows decode step runs, by module."""
    P, F = pool.GraphBufferPool, fi.PoolState
    return [P.commit, steady.SteadySlots.commit, lease.SlotLeases.take, P._commit_derived, P.free_slot, checks.validate, checks.bucket_for, table.PageTable.check_step,
            stage.stage_derived, lease.SlotLeases.free, lease.SlotLeases.after_consumer, lease.SlotLeases.claim_consumer,
            lease.SlotLeases.record, lease.CurrentStream.__call__, graph_cache.CommitGraphs.defer, F.schedule, F._kept,
            _arrays.Ranges.holds, _flashinfer_fast.FastDecodePlan.holds, batch.StepRows.decode, plan.build_plan,
            plan._plan_rows_decode, record.AttentionPlan.rows_decode]


def list_functions() -> list:
    """The functions a StepBatch decode step runs (bucketed pool, exact page lists)."""
    from mstar_attn.metadata import pages
    P, F = pool.GraphBufferPool, fi.PoolState
    S = steady.SteadySlots
    return [P.commit, P._commit_staged, P._commit_derived, P.free_slot, P.views_of, checks.validate, stage.stage_derived,
            stage.stage_listed, S.commit, S._commit_lists, S._deferred, lease.SlotLeases.free, lease.SlotLeases.record, graph_cache.CommitGraphs.defer, F.schedule,
            F._kept, _flashinfer_fast.FastDecodePlan.holds, batch.StepBatch.from_csr, plan.build_plan,
            listed.plan_listed_decode, listed.exact_lists, native.exact_lists, record.AttentionPlan.lists_decode, pages.scan_ownership,
            pages.written_hits]


def demo_functions() -> list:
    """The functions of a demo step's build_plan and commit (StepBatch plans, cross rows)."""
    from mstar_attn.capture import cross
    from mstar_attn.demo.attention import PoolAttention
    from mstar_attn.metadata import pages
    P, F = pool.GraphBufferPool, fi.PoolState
    return [PoolAttention.prepare, P.commit, P._commit_staged, P._commit_derived, cross.check, cross.stage, cross.record,
            graph_cache.CommitGraphs.run, table.PageTable.send, F.schedule, F._kept, F._plan, stage.stage_pages,
            stage.copy_ranges, plan.build_plan, plan._plan, plan._finish, pages.read_pages, pages.scan_ownership,
            _flashinfer_fast.FastDecodePlan.replan, record.groups_of]


def demo(out_dir: str, model: str) -> None:
    from mstar_attn.demo.config import DemoConfig
    from mstar_attn.demo.run import run_demo

    lp = LineProfiler()
    for f in demo_functions():
        lp.add_function(f)
    lp.runcall(run_demo, DemoConfig(model=model), out=sys.stdout)
    text = io.StringIO()
    lp.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
    open(f"{out_dir}/host_lines_demo_{model}_{cases.device_tag()}.txt", "w").write(text.getvalue())


def main(out_dir: str, lists: bool = False) -> None:
    spec = AttentionSpec(32, 8, 128, PS, cases.NUM_PAGES)
    cache = PagedKVCache.allocate(spec, "cuda")
    text = io.StringIO()
    for B in (1, 8, 64, 256):
        p = table_pool(spec, buckets=(batch.bucket_of(B),))
        eng = Engine(p, B, 2048, seed=B, room=1500)
        if lists:  # the same requests listing their pages, on a bucketed pool without a table
            listing, p = eng.lists(), list_pool(spec, B)
        graphs = one_layer(p, cache)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)

        def step():
            if eng.kv[0] > eng.start[0] + 1200:  # (the pages given up front hold 1,500 more tokens)
                eng.kv[:] = eng.start
            if not lists:
                return eng.step_only()
            eng.kv += 1
            listing.kv[:] = eng.kv
            listing.list_pages()  # (the engine's own bookkeeping: inside the profiled step, outside the listed functions)
            return listing.commit_only(p)

        for _ in range(50):
            graphs(step(), q=q)
        torch.cuda.synchronize()
        lp = LineProfiler()
        for f in (list_functions() if lists else functions()):
            lp.add_function(f)
        timed = lp(step)
        for _ in range(2000):
            graphs(timed(), q=q)
            torch.cuda.synchronize()
        print(f"===== B={B}", file=text)
        lp.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
    open(f"{out_dir}/host_lines{'_lists' if lists else ''}_{cases.device_tag()}.txt", "w").write(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    if "--demo" in sys.argv:
        demo(sys.argv[1], sys.argv[sys.argv.index("--demo") + 1])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".", "--lists" in sys.argv)
