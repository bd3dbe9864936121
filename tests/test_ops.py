"""Attention as torch.library custom ops (mstar_attn/ops.py): opcheck, a model compiled with
fullgraph=True and no graph break matching the direct calls per request, the same PlanError through
the op as through the direct call, and a CUDA graph of the compiled step (GPU)."""

import threading

import numpy as np
import pytest
import torch

import mstar_attn as ma
from mstar_attn import GraphBufferPool, PlanError, PoolLimits, step_context
from tests.helpers import fresh_seed, random_batch, spec_for


def model_step(layers, q, k, v):
    """A stand-in model: each layer stores and attends, its output feeds the next layer's queries."""
    h = q
    for layer in layers:
        h = torch.tanh(layer.forward(h, k, v)) + q  # (no step: the ops, reading step_context)
    return h


def setup(seed: int, num_layers: int = 2, q_lens=(1, 3, 1), kv_lens=(7, 9, 12), device="cpu"):
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=64, dtype=torch.float32)
    plan = ma.build_plan(random_batch(rng, list(q_lens), list(kv_lens), 4, 64), spec)
    layers = ma.Attention.for_model(spec, device, num_layers=num_layers)
    gen = torch.Generator(device=device).manual_seed(seed)
    T = plan.num_tokens
    q, k, v = (torch.randn(T, h, spec.head_dim, generator=gen, device=device)
               for h in (spec.num_qo_heads, spec.num_kv_heads, spec.num_kv_heads))
    return spec, plan, layers, q, k, v


@pytest.mark.parametrize("on", ["plan", "step"])
def test_opcheck_passes_for_every_op(on):
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=16, max_num_pages=64), device="cpu")
    step = plan if on == "plan" else pool.commit(plan)
    out = torch.empty_like(q)
    with step_context(step):
        torch.library.opcheck(torch.ops.mstar_attn.store.default, (k, v, layers[0].key))
        torch.library.opcheck(torch.ops.mstar_attn.forward.default, (q, k, v, layers[0].key))
        torch.library.opcheck(torch.ops.mstar_attn.forward.default, (q, None, None, layers[0].key, True))
        torch.library.opcheck(torch.ops.mstar_attn.attention.default, (q, k, v, out, layers[0].key))
        torch.library.opcheck(torch.ops.mstar_attn.attention.default, (q, None, None, out, layers[0].key, True))
        torch.ops.mstar_attn.attention(q, k, v, out, layers[1].key)
    assert torch.equal(out, layers[1].forward(q, k, v, step)), seed  # the op writes what the direct call returns
    with step_context(step):
        assert torch.equal(torch.ops.mstar_attn.forward(q, k, v, layers[1].key), out), seed  # (and returns it)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_has_no_graph_break_and_matches_the_direct_calls_per_request(backend):
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed)
    torch._dynamo.reset()
    before = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = torch.compile(model_step, fullgraph=True, backend=backend)
    with step_context(plan):
        got = compiled(layers, q, k, v)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == before
    _, _, twins, _, _, _ = setup(seed)  # the same step on fresh caches, layer by layer through the direct calls
    h = q
    for layer in twins:
        h = torch.tanh(layer.forward(h, k, v, plan)) + q
    for i in range(plan.batch_size):
        rows = slice(plan.qo_indptr[i], plan.qo_indptr[i + 1])
        torch.testing.assert_close(got[rows], h[rows], rtol=1e-6, atol=1e-6, msg=lambda m: f"seed {seed} request {i}: {m}")
    for mine, twin in zip(layers, twins):  # and each layer's cache holds the same K/V
        assert torch.equal(mine.cache.k, twin.cache.k) and torch.equal(mine.cache.v, twin.cache.v), seed


def test_a_split_store_and_attend_compile_too_and_keep_their_order():
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed, num_layers=1)

    def split(layer, q, k, v):
        layer.store(k, v)
        return layer.attend(q)

    with step_context(plan):
        got = torch.compile(split, fullgraph=True, backend="aot_eager")(layers[0], q, k, v)
    _, _, twins, _, _, _ = setup(seed, num_layers=1)
    torch.testing.assert_close(got, twins[0].forward(q, k, v, plan), rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")


def test_inductor_keeps_an_attention_call_whose_output_nothing_reads():
    """A compiled function that calls forward(q, k, v) and ignores its output: Inductor still runs the op (a
    declared side effect), so the step's K/V are stored, as the direct call stores them."""
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed, num_layers=1)

    def ignores(layer, q, k, v):
        layer.forward(q, k, v)
        return q * 2

    torch._dynamo.reset()
    with step_context(plan):
        torch.compile(ignores, fullgraph=True, backend="inductor")(layers[0], q, k, v)
    _, _, twins, _, _, _ = setup(seed, num_layers=1)
    twins[0].forward(q, k, v, plan)
    assert torch.equal(layers[0].cache.k, twins[0].cache.k) and torch.equal(layers[0].cache.v, twins[0].cache.v), seed


def test_bad_input_through_the_op_is_the_direct_calls_plan_error():
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed)
    with pytest.raises(PlanError) as direct:
        layers[0].forward(q[:-1], k, v, plan)
    with step_context(plan), pytest.raises(PlanError) as through_op:
        layers[0].forward(q[:-1], k, v)
    assert str(through_op.value) == str(direct.value)
    compiled = torch.compile(model_step, fullgraph=True, backend="aot_eager")
    with step_context(plan), pytest.raises(PlanError) as compiled_error:
        compiled(layers, q[:-1], k, v)
    assert str(compiled_error.value) == str(direct.value)
    with pytest.raises(PlanError) as direct:  # forward without k and v on a layer that stores
        layers[0].forward(q, None, None, plan)
    with step_context(plan), pytest.raises(PlanError) as through_op:
        layers[0].forward(q, None, None)
    assert str(through_op.value) == str(direct.value) and "give its k and v" in str(direct.value)


def test_a_wrong_out_is_refused_before_anything_is_stored():
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed, num_layers=1)
    before = layers[0].cache.k.clone()
    with step_context(plan), pytest.raises(PlanError, match=r"out is \(3, 4, 16\)"):
        torch.ops.mstar_attn.attention(q, k, v, torch.empty(3, 4, 16), layers[0].key)
    with step_context(plan), pytest.raises(PlanError, match=r"out is .*torch.float64"):
        torch.ops.mstar_attn.attention(q, k, v, torch.empty_like(q, dtype=torch.float64), layers[0].key)
    assert torch.equal(layers[0].cache.k, before), seed


def test_a_copied_layer_has_its_own_key_and_cache():
    import copy
    import pickle

    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed, num_layers=1)
    for twin in (copy.deepcopy(layers[0]), pickle.loads(pickle.dumps(layers[0]))):
        assert twin.key != layers[0].key and twin.cache.k.data_ptr() != layers[0].cache.k.data_ptr()
        with step_context(plan):
            twin.forward(q, k, v)
        assert not torch.equal(twin.cache.k, layers[0].cache.k), seed  # the copy's cache took the K/V
    shallow = copy.copy(layers[0])
    assert shallow.key != layers[0].key and shallow.cache is layers[0].cache


def test_the_op_path_names_what_is_missing():
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed)
    with pytest.raises(PlanError, match=r"no step: call the layer with forward\(q, k, v, step\), or run the model inside"):
        layers[0].forward(q, k, v)
    with step_context(plan), pytest.raises(PlanError, match="no mstar_attn.Attention layer has key -1"):
        torch.ops.mstar_attn.attention(q, k, v, torch.empty_like(q), -1)
    with step_context(plan):  # contexts nest: the inner step wins, the outer one comes back
        with step_context("inner"):
            assert ma.ops.current_step("x") == "inner"
        assert ma.ops.current_step("x") is plan
        seen = []  # and belong to their thread: another thread has none
        worker = threading.Thread(target=lambda: seen.append(pytest.raises(PlanError, ma.ops.current_step, "x")))
        worker.start()
        worker.join()
        assert len(seen) == 1 and "no step" in str(seen[0].value)


def test_each_asyncio_task_sees_its_own_step():
    """Two tasks of one event loop, each inside its own step_context, interleaved at awaits: each reads its own
    step, and none is left behind after them."""
    import asyncio

    async def serve(step, seen):
        with step_context(step):
            for _ in range(3):
                await asyncio.sleep(0)  # (the other task runs here)
                seen.append((step, ma.ops.current_step("x")))

    async def both():
        seen = []
        await asyncio.gather(serve("a", seen), serve("b", seen))
        return seen

    seen = asyncio.run(both())
    assert len(seen) == 6 and all(mine == read for mine, read in seen)
    with pytest.raises(PlanError, match="no step"):
        ma.ops.current_step("x")


@pytest.mark.gpu
def test_a_compiled_step_captures_as_one_cuda_graph_and_replays_right():
    """On CUDA: the FlashInfer backend, a committed step, the compiled model (Inductor) captured into a
    CUDA graph; replays after new K/V equal the eager direct calls per request."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=16, num_pages=64, dtype=torch.bfloat16, head_dim=64, backend="flashinfer")
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=64, max_num_pages=64), device="cuda")
    plan = ma.build_plan(random_batch(rng, [1, 1, 1], [30, 47, 5], 16, 64), spec)
    step = pool.commit(plan)
    layers, twins = (ma.Attention.for_model(spec, "cuda", num_layers=2) for _ in range(2))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for layer, twin in zip(layers, twins):  # the prefix K/V: random, the same in both
        for mine, theirs in ((layer.cache.k, twin.cache.k), (layer.cache.v, twin.cache.v)):
            mine.copy_(torch.randn(mine.shape, generator=gen, device="cuda"))
            theirs.copy_(mine)

    def inputs():
        return [torch.randn(plan.num_tokens, h, 64, generator=gen, device="cuda").to(torch.bfloat16)
                for h in (spec.num_qo_heads, spec.num_kv_heads, spec.num_kv_heads)]

    static = inputs()
    compiled = torch.compile(model_step, fullgraph=True)
    with step_context(step):
        compiled(layers, *static)  # compiles, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(layers, *static)
    for _ in range(2):
        fresh = inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        h = fresh[0]
        for layer in twins:
            h = torch.tanh(layer.forward(h, fresh[1], fresh[2], step)) + fresh[0]
        torch.cuda.synchronize()
        for i in range(plan.batch_size):
            rows = slice(plan.qo_indptr[i], plan.qo_indptr[i + 1])
            torch.testing.assert_close(out[rows].float(), h[rows].float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"seed {seed} request {i}: {m}")


def test_padded_rows_attend_the_steps_rows_and_zero_the_rest():
    """step_context(step, padded_rows=n): the ops take n rows (random padding), store and attend the step's T rows
    (the same output rows and cache bytes as the direct call on T rows) and write zeros past them; n rows
    without padded_rows, or another row count with it, are the direct call's PlanError."""
    seed = fresh_seed()
    spec, plan, layers, q, k, v = setup(seed)
    _, _, twins, _, _, _ = setup(seed)
    T, n = plan.num_tokens, plan.num_tokens + 5
    pad = lambda t: torch.cat([t, torch.randn(n - T, *t.shape[1:])])  # noqa: E731
    with step_context(plan, padded_rows=n):
        out = layers[0].forward(pad(q), pad(k), pad(v))
        layers[1].store(pad(k), pad(v))
        attended = layers[1].attend(pad(q))
    assert out.shape[0] == n and not out[T:].any() and not attended[T:].any(), seed
    assert torch.equal(out[:T], twins[0].forward(q, k, v, plan)), seed
    twins[1].store(k, v, plan)
    assert torch.equal(attended[:T], twins[1].attend(q, plan)), seed
    for mine, twin in zip(layers, twins):
        assert torch.equal(mine.cache.k, twin.cache.k) and torch.equal(mine.cache.v, twin.cache.v), seed
    with step_context(plan):
        with pytest.raises(PlanError, match=f"k has {n} rows; this mixed step takes {T}"):
            layers[0].forward(pad(q), pad(k), pad(v))
    with step_context(plan, padded_rows=n):
        with pytest.raises(PlanError, match=f"has {n + 1} rows"):
            layers[0].forward(torch.cat([pad(q), q[:1]]), torch.cat([pad(k), k[:1]]), torch.cat([pad(v), v[:1]]))
