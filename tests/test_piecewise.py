"""mstar_attn.piecewise: a compiled forward split at the attention ops, the pieces between them compiled
by Inductor; per request against the same forward run eagerly, over changing token counts (CPU)."""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from mstar_attn import Attention, AttentionSpec, PagedKVCache, StepBatch, build_plan, step_context
from mstar_attn.piecewise import compile_piecewise, is_attention, split_at_attention
from tests.helpers import assert_close_per_request, fresh_seed

HEADS, KV_HEADS, D, PS = 4, 2, 16, 4
HIDDEN = HEADS * D


def _model(seed: int, layers: int = 2, device: str = "cpu"):
    """A toy decoder: per layer q/k/v projections, Attention.forward(q, k, v) (the custom op inside a compiled
    forward), an output projection and an MLP; returns (forward(x) -> [T, HIDDEN], the Attention layers)."""
    g = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(HEADS, KV_HEADS, D, PS, 256, backend="reference", dtype=torch.float32)
    attn = [Attention(spec, 0, PagedKVCache.allocate(spec, device)) for _ in range(layers)]
    w = [(torch.randn(HIDDEN, 2 * HIDDEN, generator=g) / HIDDEN**0.5).to(device) for _ in range(layers)]
    m = [(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5).to(device) for _ in range(layers)]

    def forward(x):
        for a, wi, mi in zip(attn, w, m):
            qkv = x @ wi
            q = qkv[:, :HIDDEN].reshape(-1, HEADS, D)
            k = qkv[:, HIDDEN : HIDDEN + KV_HEADS * D].reshape(-1, KV_HEADS, D)
            v = qkv[:, HIDDEN + KV_HEADS * D : HIDDEN + 2 * KV_HEADS * D].reshape(-1, KV_HEADS, D)
            x = x + a.forward(q, k, v).reshape(-1, HIDDEN)
            x = x + torch.nn.functional.gelu(x @ mi)
        return x

    return forward, attn, spec


def _step(rng, spec, requests: int):
    """A random prefill or mixed step (some requests with a cached prefix) over fresh page lists."""
    kv = rng.integers(1, 40, requests)
    q = np.minimum(kv, rng.choice([1, 3, 40], requests))
    pages = np.split(rng.permutation(spec.num_pages)[: (-(-kv // PS)).sum()], np.cumsum(-(-kv // PS))[:-1])
    return build_plan(StepBatch.from_pages(q, kv, pages, PS), spec)


def test_the_split_puts_each_attention_call_in_a_piece_of_its_own():
    forward, _, spec = _model(0, layers=3)
    seen = []

    def backend(gm, example_inputs):
        split, attention = split_at_attention(gm)
        pieces = [n.target for n in split.graph.nodes if n.op == "call_module"]
        seen.append((pieces, attention, sum(is_attention(n) for n in gm.graph.nodes)))
        return gm

    plan = _step(np.random.default_rng(0), spec, 3)
    with step_context(plan):
        torch.compile(forward, backend=backend, fullgraph=True)(torch.randn(plan.num_tokens, HIDDEN))
    pieces, attention, calls = seen[0]
    assert calls == 3 and len(attention) == 3 and len(pieces) == 2 * 3 + 1
    assert [pieces.index(a) for a in attention] == [1, 3, 5]  # attention, then the layer's projections and MLP, ...
    for a in attention:
        assert sum(1 for _ in pieces if _ == a) == 1


def test_piecewise_matches_the_eager_forward_per_request_at_every_token_count():
    """One Dynamo graph (no break), compiled at most twice (Dynamo specializes a one-token step; every other
    step size shares one compile); each request's rows equal the eager
    forward's on the same step (same caches). Bound: 16u (float32) per request where a lone attention output
    gets 2u: the compiled pieces reorder and fuse the float32 reductions of two whole layers (projections
    over 64 and 128 terms, the MLP, the residual adds), each within a few u of the eager op's result;
    measured ~2u. A wrong attention (a dropped key: ~1e-2) is 10^4 times further off."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    forward, attn, spec = _model(seed)
    compiled = compile_piecewise(forward)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    for i in range(5):
        plan = _step(rng, spec, int(rng.integers(1, 5)))
        x = torch.randn(plan.num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + i))
        for a in attn:
            a.cache.k.normal_(generator=torch.Generator().manual_seed(seed))  # (both runs read the same cache)
            a.cache.v.normal_(generator=torch.Generator().manual_seed(seed + 1))
        with step_context(plan):
            want = forward(x)
            got = compiled(x)
        assert_close_per_request(got.reshape(-1, HEADS, D), want.reshape(-1, HEADS, D), plan, torch.float32,
                                 (f"seed {seed}", f"step {i}", f"T {plan.num_tokens}"), 16.0)
    assert sum(counters["graph_break"].values()) == breaks, f"seed {seed}"
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= 2, f"seed {seed}: a recompile per step size"


def test_a_bad_step_inside_the_compiled_forward_raises_the_direct_calls_plan_error():
    from mstar_attn import PlanError

    forward, _, spec = _model(1)
    compiled = compile_piecewise(forward)
    plan = _step(np.random.default_rng(1), spec, 2)
    with pytest.raises(PlanError, match="no step"):
        compiled(torch.randn(plan.num_tokens, HIDDEN))


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, torch.randn(n - x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)])


class FakeGraph:
    """A CUDA graph's semantics on the CPU: capture runs the function once and leaves its outputs holding garbage
    (NaN) until a replay; a replay runs it again on the same (static) inputs and writes into the same outputs.
    Not modelled: the shared memory pool (a replay computes into fresh memory, then copies), calls a capture
    forbids (a host sync), values baked into launches (a CPU scalar: the graph's key holds its value). A piece
    whose output aliases an input would be corrupted by the NaN fill: the toy model has none."""

    fn, out = None, None

    def replay(self):
        from mstar_attn.piecewise import output_tensors

        for o, n in zip(output_tensors(self.out), output_tensors(self.fn())):
            o.copy_(n)


def fake_capture(graph, memory, fn, mode="global"):
    from mstar_attn.piecewise import output_tensors

    graph.fn, graph.out = fn, fn()
    for t in output_tensors(graph.out):
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    return graph.out


@pytest.fixture
def fake_graphs(monkeypatch):
    """mstar_attn.piecewise capturing FakeGraphs on the CPU (its CUDA-graph logic, checked without a GPU)."""
    import mstar_attn.piecewise as pw

    monkeypatch.setattr(pw, "capturable", lambda args: True)
    monkeypatch.setattr(pw, "new_pool", lambda: object())
    monkeypatch.setattr(pw, "new_graph", FakeGraph)
    monkeypatch.setattr(pw, "capture_into", fake_capture)


@pytest.mark.parametrize("device", ["cpu", "cpu, fake graphs", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_forward_padded_to_a_bucket_matches_the_unpadded_one_per_request(device, request):
    """step_context(step, padded_rows=n) with the inputs padded to n rows (random padding): the compiled pieces
    run on n rows (on CUDA, and on the CPU with FakeGraphs: replaying the graph each captured for n), the
    attention ops on the step's rows; each
    request's rows equal the unpadded eager forward's (bound as above); the caches hold the step's K/V where
    the eager forward stored them (to float32 rounding: compiled projections) and nothing else changed (the
    padding rows stored nowhere). Steps of changing token counts share a bucket, so graphs replay with another
    step's metadata. A padded_rows under the step's rows, or not an int, is a PlanError."""
    from mstar_attn import PlanError
    from mstar_attn.piecewise import STATS

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphs = device != "cpu"
    if device == "cpu, fake graphs":
        request.getfixturevalue("fake_graphs")
        device = "cpu"
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    forward, attn, spec = _model(seed, device=device)
    compiled = compile_piecewise(forward)
    before = dict(STATS)
    gen = torch.Generator().manual_seed(seed)
    for i in range(6):
        plan = _step(rng, spec, int(rng.integers(1, 5)))
        n = 128 if plan.num_tokens <= 128 else 256
        x = torch.randn(plan.num_tokens, HIDDEN, generator=gen).to(device)
        fill = [tuple(torch.randn(a.cache.k.shape, generator=gen).to(device) for _ in range(2)) for a in attn]
        for a, (k, v) in zip(attn, fill):
            a.cache.k.copy_(k), a.cache.v.copy_(v)
        with step_context(plan):
            want = forward(x)
        stored = [(a.cache.k.clone(), a.cache.v.clone()) for a in attn]
        for a, (k, v) in zip(attn, fill):
            a.cache.k.copy_(k), a.cache.v.copy_(v)
        with step_context(plan, padded_rows=n):
            got = compiled(_pad(x, n))
        assert got.shape[0] == n, seed
        assert_close_per_request(got[: plan.num_tokens].reshape(-1, HEADS, D), want.reshape(-1, HEADS, D), plan,
                                 torch.float32, (f"seed {seed}", f"step {i}", f"T {plan.num_tokens}", n), 16.0)
        written = torch.zeros(spec.num_pages * PS + PS, dtype=torch.bool)  # (the scratch page's slots included)
        written[torch.from_numpy(plan.slot_mapping.copy())] = True
        for a, (k, v), (k0, v0) in zip(attn, stored, fill):
            for got_c, want_c, was in ((a.cache.k, k, k0), (a.cache.v, v, v0)):
                got_c, want_c, was = (t.reshape(-1, KV_HEADS, D).cpu() for t in (got_c, want_c, was))
                assert torch.equal(got_c[~written[: got_c.shape[0]]], was[~written[: got_c.shape[0]]]), (seed, i)
                assert torch.allclose(got_c[written[: got_c.shape[0]]], want_c[written[: got_c.shape[0]]],
                                      rtol=1e-4, atol=1e-5), (seed, i)
    if graphs:
        assert STATS["captured"] - before["captured"] >= 3 and STATS["replayed"] - before["replayed"] > \
            STATS["captured"] - before["captured"], (seed, STATS, before)
    for bad in (plan.num_tokens - 1, True, 2.0):
        with pytest.raises(PlanError, match="padded_rows must be an int of at least"):
            with step_context(plan, padded_rows=bad):
                pass


def test_pieces_that_write_into_their_inputs_are_found():
    """mutates_inputs: a piece writing into an input (an in-place method, an in-place operator, through a view)
    is found, so it is never captured as a graph; an out-of-place piece is not."""
    from mstar_attn.piecewise import mutates_inputs

    def pieces(fn, *args):
        found = []

        def backend(gm, example_inputs):
            found.append(mutates_inputs(gm))
            return gm

        torch._dynamo.reset()
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
        return found

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    assert pieces(lambda a, b: torch.tanh(a) + b, x.clone(), y) == [False]
    assert pieces(lambda a, b: a.add_(b), x.clone(), y) == [True]
    assert pieces(lambda a, b: a[:2].mul_(b[:2]), x.clone(), y) == [True]

    def iadd(a, b):
        a += b
        return a
    assert pieces(iadd, x.clone(), y) == [True]


def test_the_backend_never_captures_a_piece_that_writes_an_input_in_any_form():
    """piecewise_backend reads the fake inputs' version counters around each piece at compile time: a write through
    out=, inplace=True or torch.relu_ (forms mutates_inputs does not see) leaves that piece uncaptured (graphable
    False), as an in-place method does; an out-of-place piece stays capturable."""
    import torch.nn.functional as F

    from mstar_attn.piecewise import _Compiled, piecewise_backend

    got = []

    def backend(gm, example_inputs):
        got.append(piecewise_backend(gm, example_inputs))
        return got[-1]

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    cases = [(lambda a, b: torch.add(a, b, out=a) * 2, False), (lambda a, b: F.relu(a, inplace=True) + b, False),
             (lambda a, b: torch.relu_(a) + b, False), (lambda a, b: torch.tanh(a) + b, True)]
    for i, (fn, graphable) in enumerate(cases):
        torch._dynamo.reset()
        got.clear()
        a = x.clone()
        assert torch.allclose(torch.compile(fn, backend=backend, fullgraph=True)(a, y), fn(x.clone(), y)), i
        pieces = [m for m in got[0].modules() if isinstance(m, _Compiled)]
        assert [p.graphable for p in pieces] == [graphable], (i, [p.graphable for p in pieces])


def test_another_models_parameters_get_a_graph_of_their_own(fake_graphs):
    """A compiled piece called with other parameters of the same shapes (another model, reloaded weights) does
    not replay the graph captured over the first ones (which reads its parameters in place): the key holds their
    addresses. FakeGraphs on the CPU; each output equals the piece run directly on its own parameters."""
    from mstar_attn.piecewise import _Compiled

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fn = lambda x, w: x @ w  # noqa: E731
    piece = _Compiled(fn, {"memory": None, "outputs": set()})
    x = torch.randn(8, 4, generator=gen)
    w1, w2 = (torch.nn.Parameter(torch.randn(4, 4, generator=gen), requires_grad=False) for _ in range(2))
    _, _, spec = _model(seed, layers=1)
    step = _step(np.random.default_rng(seed), spec, 2)
    with step_context(step, padded_rows=max(8, step.num_tokens)):
        for w in (w1, w2, w1, w2):
            assert torch.equal(piece(x, w), x @ w), seed
    assert len(piece.graphs) == 2, (seed, list(piece.graphs))
    # a CPU scalar (a module float Dynamo lifts) is baked into a graph: its value is part of the key, and past
    # MAX_VARIANTS values (a scalar that changes every call) the piece runs as compiled
    from mstar_attn.piecewise import MAX_VARIANTS

    scaled = _Compiled(lambda x, w, c: (x @ w) * c, {"memory": None, "outputs": set()})
    with step_context(step, padded_rows=max(8, step.num_tokens)):
        for c in (2.0, 3.0, 2.0, 3.0, *range(10, 10 + MAX_VARIANTS)):
            assert torch.equal(scaled(x, w1, torch.tensor(c, dtype=torch.float64)), (x @ w1) * c), (seed, c)
    assert len(scaled.graphs) == MAX_VARIANTS, (seed, list(scaled.graphs))


def test_a_capture_that_fails_warns_once_and_the_piece_runs_as_compiled(fake_graphs, monkeypatch):
    """A piece whose capture raises (another thread invalidated it, say) after its warm-up ran: a RuntimeWarning,
    the compiled piece's own output, and the key is never captured again (no retry at every call)."""
    import mstar_attn.piecewise as pw

    tries = []

    def failing(graph, memory, fn, mode="global"):
        tries.append(mode)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(pw, "capture_into", failing)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    piece = pw._Compiled(lambda x, w: x @ w, {"memory": None, "outputs": set()})
    x, w = torch.randn(8, 4, generator=gen), torch.nn.Parameter(torch.randn(4, 4, generator=gen), requires_grad=False)
    _, _, spec = _model(seed, layers=1)
    step = _step(np.random.default_rng(seed), spec, 2)
    with step_context(step, padded_rows=max(8, step.num_tokens)):
        with pytest.warns(RuntimeWarning, match="did not capture .*runs as compiled"):
            assert torch.equal(piece(x, w), x @ w), seed
        assert torch.equal(piece(x, w), x @ w), seed
    assert tries == ["thread_local"], tries
