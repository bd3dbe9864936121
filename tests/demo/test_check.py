"""The check against transformers: it passes on the reference backend and catches wrong attention."""

import pytest

pytest.importorskip("transformers")

from mstar_attn import Attention, Mode  # noqa: E402
from mstar_attn.demo import DemoConfig, StepAttention, run_demo  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402


def test_matches_transformers(served):
    res, _ = served
    assert res.matched and res.tokens_match
    assert all(c.err <= c.tol for c in res.checks)
    assert res.max_logit_err < 1e-4  # float32: ~1e-6 in practice, see mstar_attn.demo.check.REL
    assert sum(c.tokens_checked for c in res.checks) == res.generated_tokens  # float32: every token, no near-tie escape
    assert len(res.checks) == SMALL.requests


class RowShift(Attention):
    """Each token gets the attention output of the token before it (across requests too)."""

    def forward(self, q, k, v, step):
        return super().forward(q, k, v, step).roll(1, 0)


class Scaled(Attention):
    """Attention outputs 2% too small."""

    def forward(self, q, k, v, step):
        return super().forward(q, k, v, step) * 0.98


class DropsDecodeWrites(Attention):
    """Forgets to store K/V in decode steps: later steps read whatever the pages held."""

    def store(self, k, v, step):
        if step.mode is not Mode.DECODE:
            super().store(k, v, step)


def seam(layer_class) -> StepAttention:
    attn = StepAttention("reference")
    attn.layer_class = layer_class
    return attn


@pytest.mark.parametrize("broken", [RowShift, Scaled, DropsDecodeWrites])
def test_check_catches_wrong_attention(broken):
    res = run_demo(SMALL, attention=seam(broken))
    assert not res.matched
    assert res.max_logit_err > max(c.tol for c in res.checks)


def test_half_precision_stops_at_near_ties():
    res = run_demo(DemoConfig(requests=4, layers=2, hidden=128, seed=1, backend="reference", device="cpu", dtype="bfloat16"))
    assert res.matched
    assert 0 < sum(c.tokens_checked for c in res.checks) <= res.generated_tokens
