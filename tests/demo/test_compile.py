"""`demo --compile`: each family's step forward through torch.compile(fullgraph=True), attention as the
mstar_attn custom ops, whole (full) or split at attention (piecewise), with no graph break, every logit
checked against transformers (CPU)."""

import attrs
import pytest

from tests.demo.common import SMALL


@pytest.mark.parametrize("model, mode", [("llama", "full"), ("gemma2", "full"), ("bart", "full"),
                                         ("llama", "piecewise"), ("bart", "piecewise")])
def test_compiled_demo_has_no_graph_break_and_matches_transformers(model, mode, monkeypatch):
    pytest.importorskip("transformers")
    import torch._inductor.config

    from mstar_attn.demo import run_demo

    # compile in this process: no pool of compile workers left spinning into the tests after this one
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    torch._dynamo.reset()  # (a fresh Dynamo cache, as a fresh process has: the models of earlier tests add guards)

    res = run_demo(attrs.evolve(SMALL, model=model, compile=mode, requests=4))
    assert res.graph_breaks == 0
    assert res.compile_s > 0  # it did compile (and those steps were kept out of the step times)
    assert res.matched, [(c.rid, c.err, c.tol) for c in res.checks if not c.ok]
