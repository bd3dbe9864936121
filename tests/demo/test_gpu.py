"""GPU: FlashInfer through the pool, eager and with the decode forward captured as CUDA graphs."""

import attrs
import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn import Mode  # noqa: E402
from mstar_attn.demo import DemoConfig, run_demo, summary  # noqa: E402

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
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_speculative_demo_replays_each_draft_round_as_one_graph(backend):
    """demo --speculate 4 on the GPU (bf16, graphs): a separate draft and the target as its own draft;
    tokens equal plain greedy decoding up to each request's first near-tie, every target logit within
    bounds, and every draft round replayed as one CUDA graph."""
    pytest.importorskip("flashinfer" if backend == "flashinfer" else "flash_attn.cute")
    from mstar_attn.demo.speculate import run_speculative
    from mstar_attn.demo.speculate import summary as spec_summary

    for draft in ("small", "self"):
        res = run_speculative(attrs.evolve(GPU, backend=backend, graphs=True), 4, draft)
        print(spec_summary(res))
        assert res.matched, spec_summary(res)
        assert res.replayed_rounds == res.rounds > 0 and res.round_graphs > 0
        assert res.replayed_verify == res.rounds and res.verify_graphs > 0
        if draft == "self":
            assert res.accepted == res.proposed and res.verify_steps < res.plain_steps


@pytest.mark.gpu
@gpu
def test_tree_speculation_on_flashinfer_with_graphs():
    """demo --speculate 4 --tree 2 on FlashInfer with graphs (bf16): tree verify steps through FlashInfer's
    prefix pass and masked tree part, every draft round and tree verify step replayed as one CUDA graph each,
    tokens equal plain greedy decoding up to
    each request's first near-tie, every target logit within bounds; the self draft's first choice is the
    target's pick at every node but near-ties (bf16: the draft's decode kernels and the verify's round apart)."""
    pytest.importorskip("flashinfer")
    from mstar_attn.demo.speculate import run_speculative
    from mstar_attn.demo.speculate import summary as spec_summary

    for draft in ("small", "self"):
        res = run_speculative(attrs.evolve(GPU, backend="flashinfer", graphs=True), 4, draft, width=2)
        print(spec_summary(res))
        assert res.matched, spec_summary(res)
        assert res.width == 2 and res.rounds > 0
        assert res.replayed_rounds == res.replayed_verify == res.rounds and res.verify_graphs > 0, spec_summary(res)
        if draft == "self":
            # (a miss may still accept every level: the draft's second choice was the target's pick there)
            assert res.proposed > 0 and (res.accepted == res.proposed or res.misses), spec_summary(res)
            assert all(m <= 2 * tol for m, tol in res.misses), res.misses

@pytest.mark.gpu
@gpu
def test_shared_system_prompts_through_cascade_with_graphs():
    """demo --cascade always on FlashInfer with graphs (bf16): the shared system prompts are read once
    per prefix group in some steps; every logit within the oracle's bound, every decode step replayed
    (cascade steps through their own graphs, captured next to the flat ones)."""
    pytest.importorskip("flashinfer")
    res = run_demo(attrs.evolve(GPU, graphs=True, cascade="always", seed=1))
    print(summary(res))
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert res.cascade_steps >= 1 and res.replayed == res.modes[Mode.DECODE.value] > 0
    assert res.num_graphs == 2 * 4 + 2 * 3  # 2 slots x buckets 1, 2, 4, 8 flat; buckets 2, 4, 8 cascade


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_piecewise_with_graphs_replays_the_pieces_of_every_step(backend):
    """demo --compile piecewise --graphs (bf16): decode steps replay the whole compiled forward's graph, and
    every other step (prefill chunks, mixed steps) pads to a token-count bucket and replays the pieces between
    its attention calls; the tokens and logits match transformers."""
    pytest.importorskip("flashinfer" if backend == "flashinfer" else "flash_attn.cute")
    torch._dynamo.reset()
    res = run_demo(attrs.evolve(GPU, backend=backend, graphs=True, compile="piecewise"))
    print(summary(res))
    assert res.matched, [(c.err, c.tol) for c in res.checks]
    assert res.graph_breaks == 0 and res.replayed == res.modes[Mode.DECODE.value] > 0
    assert res.piece_graphs > 0 and res.piece_replays > res.piece_graphs, summary(res)
    assert "CUDA graphs captured per token-count bucket" in summary(res)
