"""The gpt-oss adapter: attention sinks (each layer's own), sliding-window and full layers, served and
checked against transformers; a run whose attention drops the sinks fails the check."""

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn import Attention  # noqa: E402
from mstar_attn.demo import StepAttention, run_demo, summary  # noqa: E402
from mstar_attn.demo import gpt_oss  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402

GPT_OSS = attrs.evolve(SMALL, model="gpt_oss", requests=6, window=8)


class DropsSinks(Attention):
    """A layer whose attention ignores its sinks (as a backend that dropped them would): sink logits of -inf
    add nothing to any denominator, so this is attention without sinks, through every check."""

    def __init__(self, spec, layer, cache, sinks=None):
        super().__init__(spec, layer, cache, sinks)
        if self.sinks is not None:
            self.sinks = torch.full_like(self.sinks, float("-inf"))


def test_gpt_oss_matches_transformers_with_its_sinks():
    res = run_demo(GPT_OSS)
    assert res.matched and res.tokens_match, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    assert max(len(t) for t in res.tokens.values()) > 2 * GPT_OSS.window  # requests outgrow the window
    text = summary(res)
    assert "gpt-oss (attention sinks drawn" in text and "matches transformers: yes" in text


def test_the_clis_default_size_in_bf16_matches_transformers():
    """The CLI's GPU size (4 layers, hidden 512, 8 requests) in bf16, on the CPU: the check's bf16 tolerance
    holds for gpt-oss too (its experts chosen by top-k, kept off routing ties by the router's bias)."""
    res = run_demo(attrs.evolve(SMALL, model="gpt_oss", requests=8, layers=4, hidden=512, window=8, dtype="bfloat16"))
    assert res.matched and res.tokens_match, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]


def test_a_run_that_drops_the_sinks_fails_the_check():
    """The demo's sinks are large enough to matter: without them (the same run, every other bit equal) the
    logits leave the check's tolerance for every request."""
    attn = StepAttention("reference")
    attn.layer_class = DropsSinks
    res = run_demo(GPT_OSS, attention=attn)
    assert not res.matched and all(not c.ok for c in res.checks), [(c.rid, c.err, c.tol) for c in res.checks]


def test_the_model_draws_large_sinks_and_its_layers_carry_them():
    model = gpt_oss.build_model(attrs.evolve(GPT_OSS.resolve(), layers=2), torch.float32, torch.device("cpu"))
    sinks = gpt_oss.layer_sinks(model)
    assert len(sinks) == 2 and all(s.dtype == torch.float32 and s.shape == (GPT_OSS.heads,) for s in sinks)
    assert torch.cat(sinks).std() > gpt_oss.SINK_STD / 2  # (transformers' own init: std 0.05)
    fields = gpt_oss.spec_fields(model)
    assert all(g.sinks for g in fields["groups"]) and fields["layer_groups"] == (1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, package", [("flashinfer", "flashinfer"), ("flash_attn", "flash_attn.cute")])
def test_gpt_oss_on_the_gpu_with_graphs_matches_transformers(backend, package):
    """FlashInfer (sinks applied by the log-sum-exp) and FlashAttention-4 (its learnable sink), bf16, decode
    steps replayed as CUDA graphs: every logit and greedy token against transformers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip(package)
    res = run_demo(attrs.evolve(GPT_OSS, backend=backend, device=None, dtype=None, hidden=None, graphs=True,
                                requests=8))
    assert res.matched and res.tokens_match, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    assert res.graph_us, "no decode step replayed"
