"""The end-to-end demo: a random Llama served through mstar_attn vs transformers (CPU, and GPU-marked)."""

import sys
import types

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn import Mode  # noqa: E402
from mstar_attn.__main__ import main  # noqa: E402
from mstar_attn.demo import DemoConfig, DemoError, PageAllocator, StepAttention, run_demo, summary  # noqa: E402

SMALL = DemoConfig(requests=6, layers=2, hidden=128, seed=0, backend="reference", device="cpu", dtype="float32")


class Counting(StepAttention):
    """The reference backend, counting the seam's calls."""

    def __init__(self):
        super().__init__("reference")
        self.calls = {"prepare": 0, "write_kv": 0, "run": 0}

    def prepare(self, plan):
        self.calls["prepare"] += 1
        return super().prepare(plan)

    def write_kv(self, ctx, k, v, cache):
        self.calls["write_kv"] += 1
        super().write_kv(ctx, k, v, cache)

    def run(self, ctx, q, cache, group, **kv):
        self.calls["run"] += 1
        return super().run(ctx, q, cache, group, **kv)


@pytest.fixture(scope="module")
def served():
    attn = Counting()
    return run_demo(SMALL, attention=attn), attn


def test_matches_transformers(served):
    res, _ = served
    assert res.matched and res.tokens_match
    assert all(c.err <= c.tol for c in res.checks)
    assert res.max_logit_err < 1e-4  # float32: ~1e-6 in practice, see demo.REL
    assert sum(c.tokens_checked for c in res.checks) == res.generated_tokens  # float32: every token, no near-tie escape
    assert len(res.checks) == SMALL.requests


def test_trace_exercises_the_engine(served):
    res, attn = served
    assert res.modes[Mode.MIXED.value] >= 1  # a prompt prefilled beside other requests' decode tokens
    assert res.modes[Mode.DECODE.value] >= 1
    assert res.prefix_hits >= 1 and res.shared_tokens >= SMALL.page_size  # whole pages read from another request
    assert res.pages_reused >= 1  # finished requests' pages went to newcomers
    assert sum(res.modes.values()) == res.steps == len(res.step_us) == len(res.plan_us)
    assert attn.calls == {"prepare": res.steps, "write_kv": res.steps * SMALL.layers, "run": res.steps * SMALL.layers}
    assert set(res.served) == {"reference"}


class RowShift(StepAttention):
    """Each token gets the attention output of the token before it (across requests too)."""

    def run(self, ctx, q, cache, group, **kv):
        return super().run(ctx, q, cache, group, **kv).roll(1, 0)


class Scaled(StepAttention):
    """Attention outputs 2% too small."""

    def run(self, ctx, q, cache, group, **kv):
        return super().run(ctx, q, cache, group, **kv) * 0.98


class DropsDecodeWrites(StepAttention):
    """Forgets to store K/V in decode steps: later steps read whatever the pages held."""

    def write_kv(self, ctx, k, v, cache):
        if ctx.mode is not Mode.DECODE:
            super().write_kv(ctx, k, v, cache)


@pytest.mark.parametrize("broken", [RowShift, Scaled, DropsDecodeWrites])
def test_check_catches_wrong_attention(broken):
    res = run_demo(SMALL, attention=broken("reference"))
    assert not res.matched
    assert res.max_logit_err > max(c.tol for c in res.checks)


def test_half_precision_stops_at_near_ties():
    res = run_demo(DemoConfig(requests=4, layers=2, hidden=128, seed=1, backend="reference", device="cpu", dtype="bfloat16"))
    assert res.matched
    assert 0 < sum(c.tokens_checked for c in res.checks) <= res.generated_tokens


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


def test_cli(capsys):
    assert main(["demo", "--requests", "3", "--layers", "2", "--hidden", "128", "--backend", "reference", "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    assert "matches transformers: yes" in cap.out and "tokens/s" in cap.out and "build_plan + commit" in cap.out
    assert "3/3 requests" in cap.err  # the progress bar goes to stderr
    assert "decode step" not in cap.out  # graphs off: no step-time comparison


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA defaults and messages")
def test_defaults_without_cuda():
    cfg = DemoConfig().resolve()
    assert (cfg.backend, cfg.graphs, cfg.device, cfg.dtype, cfg.hidden) == ("reference", False, "cpu", "float32", 256)
    gpu = DemoConfig(backend="flashinfer").resolve()  # a GPU backend: graphs on, head dim 64
    assert gpu.graphs and gpu.hidden == 512 and gpu.hidden // gpu.heads == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA messages")
def test_cli_refuses_gpu_paths_without_cuda(capsys):
    assert main(["demo", "--backend", "flashinfer"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["demo", "--graphs"]) == 2
    assert "--graphs needs a GPU backend" in capsys.readouterr().err
    assert main(["demo", "--backend", "flashinfer_ragged"]) == 2
    assert "serves only prefill steps" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_bench_on_cpu_exits_2_with_a_message(capsys):
    assert main(["bench"]) == 2  # mstar_attn.tuning.bench_main: no CUDA
    assert "mstar-attn bench:" in capsys.readouterr().err


def test_bench_forwards_its_arguments_and_exit_code(monkeypatch):
    seen = []
    fake = types.ModuleType("mstar_attn.tuning")
    fake.bench_main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "mstar_attn.tuning", fake)
    assert main(["bench", "--help", "--shapes", "decode", "-x"]) == 7
    assert seen == [["--help", "--shapes", "decode", "-x"]]


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
    assert len(res.commit_us) == len(res.step_us) == res.steps
    text = summary(res)
    assert "decode step: graphs" in text and "vs eager" in text and "host clock" in text
    assert f"CUDA graphs replayed {res.replayed} of {res.replayed} decode steps" in text


def test_reference_seam_cannot_capture():
    with pytest.raises(DemoError, match="--graphs needs a GPU backend"):
        run_demo(attrs.evolve(SMALL, graphs=True), attention=StepAttention("reference"))


# ----------------------------------------------------------------------------------------------------
# GPU: FlashInfer through the pool, eager and with the decode forward captured as CUDA graphs.

GPU = DemoConfig(backend="flashinfer", hidden=512, heads=8, kv_heads=2, requests=8, seed=3)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_runs():
    """The same trace served twice on FlashInfer, bf16: with CUDA graphs (True) and without (False)."""
    pytest.importorskip("flashinfer")
    return {graphs: run_demo(attrs.evolve(GPU, graphs=graphs)) for graphs in (True, False)}


@pytest.mark.gpu
@gpu
def test_flashinfer_demo_with_graphs_matches_transformers_and_reports_step_times(gpu_runs):
    res = gpu_runs[True]
    print(summary(res))
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert set(res.served) == {"flashinfer"} and sum(res.modes.values()) == res.steps
    assert res.replayed == res.modes[Mode.DECODE.value] > 0  # every decode step replayed a graph
    assert res.num_graphs == 2 * 4  # 2 pool slots x buckets 1, 2, 4, 8
    assert len(res.eager_us) == res.replayed and min(res.graph_us + res.eager_us) > 0
    text = summary(res)
    assert "decode step: graphs" in text and "vs eager" in text and "CUDA events" in text


@pytest.mark.gpu
@gpu
def test_flashinfer_demo_without_graphs_matches_transformers(gpu_runs):
    res = gpu_runs[False]
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert res.modes[Mode.DECODE.value] > 0 and res.replayed == 0 and "decode step" not in summary(res)


@pytest.mark.gpu
@gpu
def test_graphs_serve_the_same_tokens_as_eager(gpu_runs):
    """Eager steps run padded to the same buckets as the graphs, so both compute the same kernels on
    the same rows: the same greedy tokens, and the same logits (so the same errors vs the oracle)."""
    with_graphs, eager = gpu_runs[True], gpu_runs[False]
    assert with_graphs.tokens == eager.tokens
    assert [c.err for c in with_graphs.checks] == pytest.approx([c.err for c in eager.checks], rel=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("args", [[], ["--backend", "auto", "--requests", "4", "--no-graphs"]])
def test_cli_on_gpu(capsys, args):
    pytest.importorskip("flashinfer")
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert "matches transformers: yes" in out and "flashinfer" in out
    assert ("decode step: graphs" in out) == (not args)  # the CUDA default: FlashInfer with graphs on
