"""The end-to-end demo on the CPU: a random Llama served through the reference backend vs transformers."""

import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn import Mode  # noqa: E402
from mstar_attn.__main__ import main  # noqa: E402
from mstar_attn.demo import DemoConfig, DemoError, PageAllocator, StepAttention, run_demo  # noqa: E402

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

    def run(self, ctx, q, cache, group):
        self.calls["run"] += 1
        return super().run(ctx, q, cache, group)


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

    def run(self, ctx, q, cache, group):
        return super().run(ctx, q, cache, group).roll(1, 0)


class Scaled(StepAttention):
    """Attention outputs 2% too small."""

    def run(self, ctx, q, cache, group):
        return super().run(ctx, q, cache, group) * 0.98


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
    out = capsys.readouterr().out
    assert "matches transformers: yes" in out and "3/3 requests" in out and "tokens/s" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA messages")
def test_cli_refuses_gpu_paths_without_cuda(capsys):
    assert main(["demo", "--backend", "flashinfer"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["demo", "--graphs"]) == 2
    assert "--graphs needs a GPU backend" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_demo_matches_transformers_in_bf16():
    pytest.importorskip("flashinfer")
    res = run_demo(DemoConfig(backend="flashinfer", hidden=512, heads=8, kv_heads=2, requests=8, seed=3))
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert res.modes["decode"] > 0 and sum(res.modes.values()) == res.steps
