"""mstar_attn/warmup.py: the kinds of step warm-up runs, per backend and spec (pure, no GPU); warm-up
itself on the CPU reference backend; `python -m mstar_attn warmup --list` for every demo model; and on
the H100, warm-up of a FlashInfer spec with window and soft-capped groups, then the same kinds served
by the engine's own pool, per request against the reference."""

import contextlib
import io

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, Mode, PlanError, PoolLimits
from mstar_attn.__main__ import main
from mstar_attn.warmup import kinds, warmup

GROUPS = (LayerGroup(), LayerGroup("window", window=8))


def _names(spec, backends=None):
    return [k.name for k in kinds(spec, backends)]


def test_kinds_follow_the_backends_modes_and_the_specs_groups():
    spec = AttentionSpec(8, 2, 64, 4, 100, groups=GROUPS, layer_groups=(0, 1))
    every = ["flashinfer decode", "flashinfer decode batch 257", "flashinfer verify q_len 2", "flashinfer prefill q_len 2",
             "flashinfer prefill q_len 129"]
    assert _names(spec) == every
    cross = AttentionSpec(8, 8, 64, 4, 100, groups=(LayerGroup(), LayerGroup("cross")), layer_groups=(0, 1))
    assert _names(cross) == [n for n in every if "verify" not in n]  # (no verify: cross layers are not causal)
    shared = AttentionSpec(8, 2, 64, 4, 100, cascade="auto")
    assert "flashinfer decode cascade" in _names(shared) and "flash_attn decode cascade" not in _names(shared, ("flash_attn",))
    assert _names(spec, ("flashinfer_ragged",)) == ["flashinfer_ragged prefill q_len 2", "flashinfer_ragged prefill q_len 129"]
    ref = AttentionSpec(4, 2, 16, 4, 100, dtype=torch.float32, backend="reference")
    assert [k.mode for k in kinds(ref)] == [Mode.DECODE, Mode.DECODE, Mode.VERIFY, Mode.PREFILL, Mode.PREFILL]


def test_kinds_refuse_what_a_backend_cannot_serve():
    with pytest.raises(PlanError, match="unknown backend"):
        kinds(AttentionSpec(8, 2, 64, 4, 100), ("nope",))
    with pytest.raises(PlanError, match="spec.dtype"):
        kinds(AttentionSpec(8, 2, 64, 4, 100, dtype=torch.float32))  # (FlashInfer serves half dtypes)
    with pytest.raises(PlanError, match="spec"):
        kinds("not a spec")
    cross = AttentionSpec(8, 8, 64, 4, 100, groups=(LayerGroup(), LayerGroup("cross")), layer_groups=(0, 1))
    with pytest.raises(PlanError, match="new K/V only"):
        kinds(cross, ("flashinfer_ragged",))


def test_warmup_runs_every_kind_on_the_cpu_reference_backend():
    spec = AttentionSpec(4, 2, 16, 4, 100, dtype=torch.float32, backend="reference", groups=GROUPS, layer_groups=(0, 1))
    seen = []
    report = warmup(spec, device="cpu", progress=lambda i, n, t: seen.append((i, n, t.kind.name)))
    assert [t.kind for t in report.times] == list(kinds(spec))
    assert seen == [(i + 1, len(kinds(spec)), k.name) for i, k in enumerate(kinds(spec))]
    assert all(t.cold_s > 0 and t.warm_s > 0 for t in report.times) and "total" in str(report)



def test_tree_kinds_only_when_asked_and_where_trees_are_served():
    """trees=True adds a bucketed and an unbucketed tree verify step per backend that verifies trees, for specs
    whose groups are all full causal attention; none for other backends or groups, none unless asked. On the CPU
    reference backend they run."""
    spec = AttentionSpec(8, 2, 64, 4, 100)
    assert [k.name for k in kinds(spec, trees=True)] == _names(spec) + ["flashinfer verify q_len 2 tree",
                                                                         "flashinfer verify q_len 2 tree batch 3"]
    assert not any(k.tree for k in kinds(spec, ("flash_attn",), trees=True))
    window = AttentionSpec(8, 2, 64, 4, 100, groups=GROUPS, layer_groups=(0, 1))
    assert not any(k.tree for k in kinds(window, trees=True))
    ref = AttentionSpec(4, 2, 16, 4, 100, dtype=torch.float32, backend="reference")
    report = warmup(ref, device="cpu", trees=True)
    assert [t.kind for t in report.times if t.kind.tree] == [k for k in kinds(ref, trees=True) if k.tree] != []

@pytest.mark.parametrize("model", ["llama", "gemma2", "bart"])
def test_the_warmup_list_runs_anywhere(model):
    pytest.importorskip("transformers")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["warmup", "--list", "--model", model]) == 0
    text = out.getvalue()
    assert f"{model}:" in text and "flashinfer decode" in text and "flashinfer prefill q_len 2" in text, text
    assert ("window 8" in text) == (model == "gemma2") and ("cross" in text) == (model == "bart"), text
    assert ("flashinfer_ragged dense" in text) == (model == "bart"), text  # (the encoder's dense path)


@pytest.mark.smoke
@pytest.mark.gpu
def test_warmup_then_serving_the_same_kinds_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from mstar_attn import GraphBufferPool, PagedKVCache, StepBatch, build_plan, run
    from mstar_attn.kernels import reference
    from tests.helpers import assert_close_per_request, fresh_seed

    spec = AttentionSpec(8, 2, 64, 4, 64, soft_cap=30.0, groups=GROUPS, layer_groups=(0, 1))
    report = warmup(spec)
    assert [t.kind for t in report.times] == list(kinds(spec))
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=64, max_num_pages=spec.num_pages))
    caches = [PagedKVCache.allocate(spec, "cuda", group=g) for g in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for c in caches:
        for t in (c.k, c.v):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
    pages = rng.permutation(spec.num_pages).astype(np.int32)
    for q_len in (1, 2, 5):  # decode, verify, a prefix-extending chunk
        kv = rng.integers(q_len + 1, 40, 4).astype(np.int32)
        need = -(-kv // 4)
        lists = np.split(pages[: need.sum()], np.cumsum(need)[:-1])
        plan = build_plan(StepBatch.from_pages(np.full(4, q_len, np.int32), kv, lists, 4), spec)
        step = pool.commit(plan)
        q = torch.randn(plan.num_tokens, 8, 64, generator=gen, device="cuda").to(torch.bfloat16)
        for g, c in enumerate(caches):
            step.mark_stored(c)  # (random K/V already at every slot)
            got = run(step, q, c, group=g)
            ref = reference.run(plan, q.float(), c, group=g)
            assert_close_per_request(got, ref, plan, torch.bfloat16, f"seed {seed}, q_len {q_len}, group {g}")


def test_the_cache_key_names_what_compiled_kernels_depend_on():
    from mstar_attn.warmup import cache_key

    key = cache_key()
    assert f"torch {torch.__version__}" in key and "flashinfer " in key and "flash-attn-4 " in key, key
    arch = "cpu" if not torch.cuda.is_available() else "sm_%d%d" % torch.cuda.get_device_capability()
    assert key.endswith(arch), key
