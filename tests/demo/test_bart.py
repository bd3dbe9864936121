"""The BART adapter: an encoder-decoder served through mstar_attn (encoder on the dense path, cross
attention on paged encoder K/V), checked against transformers."""

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn.demo import PoolAttention, run_demo, summary  # noqa: E402
from mstar_attn.demo import bart  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402

BART = attrs.evolve(SMALL, model="bart", requests=8)


def test_bart_matches_transformers_with_listed_cross_pages():
    res = run_demo(BART)
    assert res.matched and res.tokens_match, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    assert res.encoder_tokens > 0 and not res.cross_rows
    assert res.modes["decode"] > 0 and (res.modes["mixed"] + res.modes["prefill"]) > 0
    assert "BART encoder-decoder" in summary(res) and "cross page lists listed by each step" in summary(res)


def test_bart_through_a_pool_reads_cross_pages_from_its_cross_table():
    """The same trace through a CPU pool: cross page lists gathered from the pool's cross table
    (CrossRows), the same tokens and logits as the listed run within float32 rounding."""
    res = run_demo(BART, attention=PoolAttention("reference", "cpu"))
    listed = run_demo(BART)
    assert res.matched and res.cross_rows and res.tokens == listed.tokens
    assert "gathered on the device from the pool's cross table" in summary(res)


def test_the_check_sees_a_wrong_encoder_input(monkeypatch):
    """Negative control: the encoder run on each request's input reversed stores wrong cross K/V."""
    encode = bart.encode
    monkeypatch.setattr(bart, "encode", lambda m, c, layers, inputs, b: encode(m, c, layers, [x[::-1] for x in inputs], b))
    assert not run_demo(BART).matched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_bart_on_the_gpu_with_graphs(backend):
    """bf16, graphs on: every logit within the bf16 bound, tokens up to the first near-tie, every
    decode step replayed, cross page lists from the pool's cross table."""
    pytest.importorskip("flashinfer" if backend == "flashinfer" else "flash_attn.cute")
    res = run_demo(attrs.evolve(BART, backend=backend, device="cuda", dtype="bfloat16", hidden=512, layers=4,
                                graphs=True, seed=3))
    print(summary(res))
    assert res.matched, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    assert res.replayed == res.modes["decode"] > 0 and res.cross_rows
