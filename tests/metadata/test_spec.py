"""AttentionSpec and LayerGroup: every field checked at construction, by name."""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PlanError


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="flashinfer", head_dim=96), r"spec.head_dim: backend 'flashinfer'"),
        (dict(backend="flashinfer", dtype=torch.float32), r"spec.dtype: backend 'flashinfer'"),
        (dict(backend="nope"), r"unknown backend"),
        (dict(num_kv_heads=4), r"multiple of num_kv_heads"),
        (dict(page_size=0), r"page_size: expected an integer in 1"),
        (dict(page_size=2.0), r"page_size: expected a positive integer"),
        (dict(num_pages=True), r"num_pages: expected a positive integer"),
        (dict(num_pages=2**31 - 1), r"num_pages"),
        (dict(head_dim="64"), r"head_dim: expected a positive integer"),
        (dict(dtype="bfloat16"), r"spec.dtype: expected a torch.dtype"),
        (dict(sm_scale=float("nan")), r"sm_scale: expected a finite number"),
        (dict(sm_scale=-1.0), r"sm_scale must be positive"),
        (dict(soft_cap=float("inf")), r"soft_cap: expected a finite number"),
        (dict(groups=("causal",)), r"groups\[0\]: expected a LayerGroup"),
        (dict(layer_groups=(0, True)), r"layer_groups\[1\]"),
        (dict(backend=None), r"unknown backend"),
        (dict(groups=LayerGroup()), r"groups: expected a sequence"),
        (dict(groups=None), r"groups: expected a sequence"),
        (dict(layer_groups=0), r"layer_groups: expected a sequence"),
        (dict(sm_scale=10**400), r"sm_scale: expected a finite number"),
        (dict(soft_cap="1"), r"soft_cap: expected a finite number"),
        (dict(layer_groups=(0, 1)), r"layer_groups\[1\]"),
        (dict(soft_cap=-1.0), r"soft_cap"),
    ],
)
def test_spec_errors(kwargs, match):
    args = dict(num_qo_heads=6, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8, dtype=torch.bfloat16, backend="reference")
    args.update(kwargs)
    with pytest.raises(PlanError, match=match):
        AttentionSpec(**args)


@pytest.mark.parametrize("kwargs", [dict(kind="window"), dict(kind="causal", window=3), dict(kind="window", window=0),
                                    dict(kind="window", window=2.5), dict(kind="sliding")])
def test_layer_group_errors(kwargs):
    with pytest.raises(PlanError, match="window|kind"):
        LayerGroup(**kwargs)


def test_sinks_are_served_only_by_the_backends_that_declare_them():
    """A spec with an attention-sink group builds for each backend whose Capabilities declare sinks and is
    refused, naming the backend and those that serve them, for every other (and for "auto", whose steps
    fall back to FlashInfer); LayerGroup.sinks takes True or False only."""
    from mstar_attn.metadata.backends import BACKENDS, SINK_BACKENDS

    assert SINK_BACKENDS and all(BACKENDS[n].sinks for n in SINK_BACKENDS)
    groups = (LayerGroup(sinks=True), LayerGroup("window", window=4, sinks=True))
    for name, caps in BACKENDS.items():
        args = dict(num_qo_heads=6, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8, groups=groups[:1], backend=name,
                    dtype=torch.float32 if torch.float32 in caps.dtypes else torch.bfloat16)
        if caps.mla_only:
            args.update(num_qo_heads=16, num_kv_heads=1, head_dim=128, mla_rope_dim=64)
        if caps.sinks:
            assert AttentionSpec(**args).has_sinks, name
        else:
            with pytest.raises(PlanError, match=rf"backend '{name}' does not serve them \(backends that do: .*'reference'"):
                AttentionSpec(**args)
    assert not AttentionSpec(6, 2, 64, 16, 8, backend="reference").has_sinks
    assert AttentionSpec(6, 2, 64, 16, 8, groups=groups, layer_groups=(0, 1), backend="flashinfer").has_sinks
    with pytest.raises(PlanError, match=r"fp8_math: .* needs no attention sinks"):
        AttentionSpec(6, 2, 64, 16, 8, groups=groups, layer_groups=(0, 1), backend="flashinfer",
                      kv_dtype=torch.float8_e4m3fn, fp8_math=True)
    with pytest.raises(PlanError, match="LayerGroup.sinks: expected True or False"):
        LayerGroup(sinks=1)


def test_scratch_page_and_cache_shape():
    spec = AttentionSpec(8, 2, 64, 16, 100, backend="reference")
    assert spec.scratch_page == 100 and spec.cache_shape == (101, 16, 2, 64)
    assert AttentionSpec(8, 2, 64, np.int64(16), 100).page_size == 16


def test_group_of_maps_every_layer_of_a_one_group_spec_and_refuses_past_a_longer_list():
    from mstar_attn import AttentionSpec, LayerGroup, PlanError

    one = AttentionSpec(4, 2, 16, 4, 16, backend="reference")
    assert [one.group_of(i) for i in (0, 1, 31)] == [0, 0, 0]
    two = AttentionSpec(4, 2, 16, 4, 16, backend="reference", groups=(LayerGroup(), LayerGroup("window", window=8)),
                        layer_groups=(0, 1, 0))
    assert [two.group_of(i) for i in range(3)] == [0, 1, 0]
    with pytest.raises(PlanError, match="layer: 3 is past spec.layer_groups, which names 3 layers"):
        two.group_of(3)
    with pytest.raises(PlanError, match="layer: expected a layer index"):
        two.group_of(-1)
    unnamed = AttentionSpec(4, 2, 16, 4, 16, backend="reference", groups=(LayerGroup(), LayerGroup("window", window=8)))
    assert unnamed.group_of(0) == 0
    with pytest.raises(PlanError, match="layer: 1 is past spec.layer_groups, which names 1 layers"):
        unnamed.group_of(1)  # (two groups: which one layer 1 reads is the engine's to say)
