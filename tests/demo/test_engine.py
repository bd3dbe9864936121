"""The engine loop: pages, the trace's step mix, and the graph path (replay + eager timing) without CUDA."""

import attrs
import numpy as np
import pytest

pytest.importorskip("transformers")

from mstar_attn import Mode  # noqa: E402
from mstar_attn.demo import DemoError, PageAllocator, StepAttention, run_demo, summary  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402


def test_trace_exercises_the_engine(served):
    res, attn = served
    assert res.modes[Mode.MIXED.value] >= 1  # a prompt prefilled beside other requests' decode tokens
    assert res.modes[Mode.DECODE.value] >= 1
    assert res.prefix_hits >= 1 and res.shared_tokens >= SMALL.page_size  # whole pages read from another request
    assert res.pages_reused >= 1  # finished requests' pages went to newcomers
    assert sum(res.modes.values()) == res.steps == len(res.step_us) == len(res.plan_us)
    assert attn.calls == {"prepare": res.steps, "write_kv": res.steps * SMALL.layers, "run": res.steps * SMALL.layers}
    assert set(res.served) == {"reference"}


def test_page_allocator_refcounts_and_reuse():
    pages = PageAllocator(4)
    a = pages.alloc(3)
    pages.share(a[:2])
    pages.release(a)  # the two shared pages stay held
    assert sorted(pages.free) == sorted({0, 1, 2, 3} - set(a[:2])) and pages.reused == 0
    b = pages.alloc(2)
    assert pages.reused == 1 and set(b) & set(a) == {a[2]}
    pages.release(a[:2])
    assert len(pages.free) == 2
    with pytest.raises(DemoError, match="out of KV pages"):
        pages.alloc(3)


class EagerGraphs(StepAttention):
    """The graph half of the seam without CUDA: 'replays' every decode step by running the captured
    function on its static buffers, as DecodeGraphs does (copy the live rows in, run on the first rows)."""

    def capture(self, fn, static):
        self.fn, self.static = fn, static
        assert all(t.shape[0] == self.capture_rows for t in static.values())
        return 1

    def replays(self, ctx):
        return ctx.mode is Mode.DECODE

    def replay(self, ctx, inputs):
        n = inputs["ids"].shape[0]
        for name, t in inputs.items():
            self.static[name][:n].copy_(t)
        return self.fn(ctx, {name: t[:n] for name, t in self.static.items()})


def test_graph_path_replays_decode_steps_and_times_both_ways(served):
    res = run_demo(attrs.evolve(SMALL, graphs=True), attention=EagerGraphs("reference"))
    assert res.matched
    assert res.replayed == len(res.eager_us) == res.modes[Mode.DECODE.value] > 0
    assert res.tokens == served[0].tokens  # replaying changes nothing
    assert len(res.commit_us) == len(res.step_us) == len(res.replayed_steps) == res.steps
    assert sum(res.replayed_steps) == res.replayed
    text = summary(res)
    assert "decode step: graphs" in text and "vs eager" in text and "host clock" in text
    host = np.median([p + c for p, c, r in zip(res.plan_us, res.commit_us, res.replayed_steps) if r])
    assert f"host µs of those steps: build_plan + commit median {host:.0f}" in text
    assert f"CUDA graphs replayed {res.replayed} of {res.replayed} decode steps" in text


def test_shared_system_prompts_go_through_cascade_and_match_transformers():
    """--cascade always: the trace's shared system prompts (whole pages another request holds) are
    read once per prefix group in its decode and verify steps; every logit still matches
    transformers (the check run_demo makes), and the summary says how many steps ran as cascades."""
    res = run_demo(attrs.evolve(SMALL, cascade="always", requests=8, seed=1))
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert res.prefix_hits >= 2 and 1 <= res.cascade_steps <= res.modes[Mode.DECODE.value] + res.modes[Mode.VERIFY.value]
    assert "cascade always" in summary(res)
    assert run_demo(attrs.evolve(SMALL, cascade="off", requests=8, seed=1)).cascade_steps == 0
