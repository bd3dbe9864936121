"""demo --speculate: draft rounds + target verify steps equal plain greedy decoding of the target (CPU, float32)."""

import attrs
import pytest

pytest.importorskip("transformers")

from mstar_attn.demo import DemoConfig, DemoError  # noqa: E402
from mstar_attn.demo import speculate  # noqa: E402
from mstar_attn.demo.speculate import accepted_prefix, run_speculative, summary  # noqa: E402

CPU = DemoConfig(backend="reference", device="cpu", dtype="float32", requests=6, layers=4, hidden=128, heads=4,
                 kv_heads=2, seed=5)


@pytest.mark.parametrize("page_size, k", [(1, 4), (4, 4), (16, 3), (4, 8)])
def test_small_draft_matches_plain_greedy(page_size, k):
    res = run_speculative(attrs.evolve(CPU, page_size=page_size), k)
    print(summary(res))
    assert res.matched and res.greedy_checked == sum(len(t) for t in res.tokens.values()) - sum(
        len(r) for r in _prompts(page_size)), summary(res)
    assert res.rounds == res.verify_steps > 0 and res.proposed == sum(res.round_sizes) * k


def test_self_draft_accepts_every_proposal_and_saves_target_steps():
    res = run_speculative(CPU, 4, draft="self")
    print(summary(res))
    assert res.matched, summary(res)
    assert res.accepted == res.proposed > 0  # the target proposes exactly its own greedy tokens
    assert res.catch_up_steps > 0  # a fully accepted round leaves its last proposal's draft K/V to write
    assert res.verify_steps < res.plain_steps  # K + 1 tokens per target step
    assert "matches plain greedy decoding: yes" in summary(res) and "matches transformers: yes" in summary(res)


def test_the_check_sees_an_off_by_one_acceptance(monkeypatch):
    """Accepting one proposal more than the target agreed to puts a draft token in the output: the
    check against plain greedy decoding fails."""
    monkeypatch.setattr(speculate, "accepted_prefix", lambda p, picks: min(accepted_prefix(p, picks) + 1, len(p)))
    res = run_speculative(CPU, 4)
    assert not res.matched and res.greedy_agree < res.greedy_checked


def test_accepted_prefix():
    assert accepted_prefix([3, 4, 5], [3, 4, 9, 1]) == 2
    assert accepted_prefix([3, 4, 5], [2, 4, 5, 1]) == 0
    assert accepted_prefix([3, 4, 5], [3, 4, 5, 1]) == 3


@pytest.mark.parametrize("kw, match", [(dict(k=0), "--speculate"), (dict(k=16), "--speculate"),
                                       (dict(k=4, draft="big"), "--draft")])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(DemoError, match=match):
        run_speculative(CPU, **kw)


def _prompts(page_size):
    import numpy as np

    from mstar_attn.demo.engine import make_trace

    cfg = attrs.evolve(CPU, page_size=page_size).resolve()
    return [r.prompt for r in make_trace(cfg, np.random.default_rng(cfg.seed))]


def test_cascade_is_refused_with_draft_rounds():
    import attrs

    with pytest.raises(DemoError, match="--cascade serves plain decoding"):
        run_speculative(attrs.evolve(CPU, cascade="always"), 4)


@pytest.mark.parametrize("k, width, draft", [(4, 2, "small"), (3, 3, "small"), (4, 2, "self")])
def test_tree_rounds_match_plain_greedy(k, width, draft):
    """Draft trees of W tokens per level verified in one target step each (reference backend): the tokens equal
    plain greedy decoding and every target logit transformers'; the self draft's chain of first choices is
    always accepted, so its trees accept every level."""
    res = run_speculative(CPU, k, draft=draft, width=width)
    print(summary(res))
    assert res.matched, summary(res)
    assert res.width == width and f"tree W = {width} ({1 + k * width} tokens per verify)" in summary(res)
    if draft == "self":
        assert res.accepted == res.proposed > 0 and not res.misses
    else:  # some accepted path ends on a leaf beside the chain: the draft catches that position up
        assert res.catch_up_steps > 0, summary(res)


def test_a_tree_round_without_the_kv_moves_is_caught(monkeypatch):
    """Skipping the accepted path's K/V moves leaves later steps reading the tree order's K/V: with the self
    draft every round accepts a path past the first level (which moves), and the check fails."""
    from mstar_attn.metadata.tree import AcceptedMoves
    import numpy as np

    def nothing(plan, paths):
        return AcceptedMoves(src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64),
                             kept=np.array([len(p) for p in paths], np.int32))

    monkeypatch.setattr(speculate, "accepted_moves", nothing)
    res = run_speculative(CPU, 4, draft="self", width=2)
    assert not res.matched


def test_tree_rounds_refuse_what_they_cannot_serve():
    with pytest.raises(DemoError, match=r"--tree 16: a tree of 1 \+ K x W tokens holds at most 64"):
        run_speculative(CPU, 4, width=16)
    with pytest.raises(DemoError, match=r"--tree: backend 'flash_attn' does not verify token trees \(backends that do: "
                                         r"flashinfer, reference\)"):
        run_speculative(attrs.evolve(CPU, backend="flash_attn", device="cpu"), 4, width=2)


def test_tree_rounds_leave_no_stale_draft_kv(monkeypatch):
    """Before every draft round after a tree verify, the draft caches hold at each position the round reads
    (< len(tokens) - 1) the K/V a fresh draft prefill of the request's tokens gives: a path that ended on a
    leaf beside the chain was caught up, never read stale."""
    import torch

    from mstar_attn import StepBatch

    models, state = [], {"live": None, "checked": 0, "stale": []}
    init, verify, plan_round = speculate._Model.__init__, speculate._verify_tree, speculate.build_round

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        models.append((self, a, kw))

    def after_verify(res, t, live, *rest):
        verify(res, t, live, *rest)
        state["live"] = list(live)

    def before_round(batch, spec, k):
        if state["live"] is not None:
            draft, a, kw = models[1]
            ps = a[0].page_size
            for r in [r for r in state["live"] if not r.done]:
                n = len(r.tokens) - 1
                fresh = speculate._Model(*a, **kw)
                fresh.step(StepBatch.from_pages([n], [n], [r.pages], ps), r.tokens[:n])
                slots = torch.tensor([r.pages[p // ps] * ps + p % ps for p in range(n)])
                for layer, (mine, ref) in enumerate(zip(draft.layers, fresh.layers)):
                    for x, y in zip(mine.cache.flat(), ref.cache.flat()):
                        bad = ((x[slots] - y[slots]).abs().amax(dim=(1, 2)) > 1e-4).nonzero().flatten().tolist()
                        if bad:
                            state["stale"].append((r.rid, layer, bad))
                state["checked"] += 1
        return plan_round(batch, spec, k)

    monkeypatch.setattr(speculate._Model, "__init__", keep)
    monkeypatch.setattr(speculate, "_verify_tree", after_verify)
    monkeypatch.setattr(speculate, "build_round", before_round)
    res = run_speculative(CPU, 4, width=2)
    assert res.matched and res.catch_up_steps > 0 and state["checked"] > 0, summary(res)
    assert not state["stale"], state["stale"][:5]


@pytest.mark.parametrize("mode, width", [("full", 0), ("piecewise", 2)])
def test_compiled_rounds_have_no_graph_break_and_match_plain_greedy(mode, width, monkeypatch):
    """`--speculate K --compile`: both models' forwards compiled (whole, or split at attention with a tree
    verify), the draft rounds' steps and the verify steps reading the step of step_context: no graph break,
    every logit against transformers and every token against plain greedy decoding."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    torch._dynamo.reset()  # (a fresh Dynamo cache, as a fresh process has: the models of earlier tests add guards)
    res = run_speculative(attrs.evolve(CPU, compile=mode, requests=2, layers=2), 4, width=width)
    assert res.graph_breaks == 0 and res.matched, [(c.rid, c.err, c.tol) for c in res.checks if not c.ok]
    assert res.rounds > 0 and "graph breaks: 0" in summary(res)
