"""The Gemma 2 adapter: sliding-window layers on their own page lists, served and checked against transformers."""

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn import PlanError  # noqa: E402
from mstar_attn.demo import engine, run_demo, summary  # noqa: E402
from mstar_attn.demo import run as run_module  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402

GEMMA = attrs.evolve(SMALL, model="gemma2", requests=8, window=8)


@pytest.fixture(scope="module")
def gemma_run():
    return run_demo(GEMMA)


def test_gemma2_matches_transformers_while_window_pages_are_given_back(gemma_run):
    res = gemma_run
    assert res.matched and res.tokens_match, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    lengths = [len(t) for t in res.tokens.values()]
    assert max(lengths) > 3 * GEMMA.window  # requests outgrow the window (prompts of 3-24 tokens, window 8)
    held = res.pages_held
    assert held.most_own <= held.bound == 3  # (window 8 - 1) / page 4, rounded up, + 1
    assert held.peak_own < held.peak_shared
    text = summary(res)
    assert "Gemma 2" in text and "window layers on their own page lists" in text and "matches transformers: yes" in text


def test_a_shared_prompt_prefix_shares_the_window_pages_too():
    """With a window of 24 some requests start on another's prefix: its full-layer pages and the
    window pages their first step reads (the giver still holds them), and still match transformers."""
    res = run_demo(attrs.evolve(GEMMA, window=24))
    assert res.prefix_hits >= 1 and res.shared_tokens >= GEMMA.page_size
    assert res.matched and res.tokens_match
    assert res.pages_held.most_own <= res.pages_held.bound


def test_freeing_a_page_the_window_still_sees_is_refused(monkeypatch):
    """An engine bug that gives back one page too many: the next plan names the list and the
    request instead of reading a page someone else may hold."""
    def too_eager(req, own, window, page_size):
        engine.drop_passed(req, own, window - page_size, page_size)

    monkeypatch.setattr(run_module, "drop_passed", too_eager)
    with pytest.raises(PlanError, match=r"group_pages\[1\]\.first_page\[\d+\]: the list starts at logical page"):
        run_demo(GEMMA)


def test_llama_keeps_one_page_list(served):
    res, _ = served
    assert res.pages_held is None and "pages     window" not in summary(res)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_gemma2_on_the_gpu_with_graphs(backend):
    """bf16, graphs on: every logit within the bf16 bound, tokens up to the first near-tie, every
    decode step replayed, window pages given back."""
    pytest.importorskip("flashinfer" if backend == "flashinfer" else "flash_attn.cute")
    res = run_demo(attrs.evolve(GEMMA, backend=backend, device="cuda", dtype="bfloat16", hidden=512, layers=4,
                                graphs=True, seed=3))
    print(summary(res))
    assert res.matched, [(c.rid, c.err, c.tol, c.token_mismatches) for c in res.checks]
    assert res.replayed == res.modes["decode"] > 0
    assert res.pages_held.most_own <= res.pages_held.bound
