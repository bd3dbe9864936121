"""GPU: each demo served twice in one process, with its per-step eager comparison run (the demo as shipped: every
replayed decode step also runs eagerly, for the graphs-vs-eager line) and without it; prints build_plan, commit and
build_plan + commit medians, the graph step and every step's host µs. Checks whether that comparison run's cache
pollution explains the demos' host times. A diagnosis aid, no targets.
Run on the GPU: python -m benchmarks.demo_eager_ab llama gemma2 bart
"""
import sys, statistics, time
from mstar_attn.demo import engine as E
from mstar_attn.demo.run import run_demo
from mstar_attn.demo.config import DemoConfig
orig = E.Engine.__call__
def no_eager(self, plan, tokens, before=None):
    t0 = time.perf_counter_ns()
    ctx = self.attn.prepare(plan)
    self.commit_us.append((time.perf_counter_ns() - t0) / 1e3)
    if before is not None:
        before(ctx)
    inputs = E.step_inputs(plan, tokens, self.attn.token_rows(ctx), self.device)
    self.aside_us = 0.0
    self.replayed.append(bool(self.graphs and self.attn.replays(ctx)))
    if not self.replayed[-1]:
        return self.fn(ctx, inputs)[: plan.num_tokens]
    logits, us = E.timed(lambda: self.attn.replay(ctx, inputs), self.device)
    self.graph_us.append(us)
    return logits[: plan.num_tokens]
for model in sys.argv[1:]:
    for mode in ("eager", "none"):
        E.Engine.__call__ = orig if mode == "eager" else no_eager
        r = run_demo(DemoConfig(model=model))
        tot = [p + c for p, c in zip(r.plan_us, r.commit_us)]
        print(f"{model} {mode}: plan {statistics.median(r.plan_us):.0f} commit {statistics.median(r.commit_us):.0f} plan+commit {statistics.median(tot):.0f} graph {statistics.median(r.graph_us):.0f}; all {[round(t) for t in tot]}", flush=True)
