"""The backend conformance check: one committed step of one feature through a backend, every request
against exact attention (float64, per request, from the sequences themselves: independent of every
backend, the reference included).

A feature is a step shape and a spec: each mode a paged backend declares (`Capabilities.modes`), a
sliding-window group, a non-causal group, soft-capping, grouped-query heads, and attention sinks where
it declares them (`Capabilities.sinks`; large random sinks, so dropping them is far off). What a backend declares
is data (metadata/backends.py); `features(caps)` lists what the suite holds it to, so a backend that
declares a feature and ignores it fails (tests/kernels/test_conformance.py shows one that does).
"""

from __future__ import annotations

import attrs
import torch

from mstar_attn import LayerGroup
from mstar_attn.metadata.backends import Capabilities, load
from tests.helpers import assert_close_per_request, make_step, pool_of
from tests.support.exact import exact_attention


@attrs.frozen
class Feature:
    """One step to check: its new tokens and KV lengths per request, the spec's layer group and
    soft-cap, and the mode build_plan must classify it as."""

    name: str
    q_lens: tuple
    kv_lens: tuple
    mode: str
    group: LayerGroup = LayerGroup()
    soft_cap: float = 0.0


MODES = (
    Feature("decode", (1,) * 5, (1, 17, 64, 300, 1100), "decode"),
    Feature("prefill", (5, 33, 90), (5, 33, 90), "prefill"),
    Feature("extend", (7, 20), (90, 21), "extend"),
    Feature("mixed", (1, 30, 1, 4), (50, 30, 2, 100), "mixed"),
    Feature("verify", (4, 4, 4), (5, 40, 129), "verify"),
)
SHAPES = (
    Feature("window", (1, 30, 1, 4), (50, 30, 2, 100), "mixed", LayerGroup("window", window=24)),
    Feature("noncausal", (5, 33, 90), (5, 33, 90), "prefill", LayerGroup("noncausal")),
    Feature("soft_cap", (1, 30, 1, 4), (50, 30, 2, 100), "mixed", soft_cap=2.0),
)
SINKS = (
    Feature("sinks", (1, 30, 1, 4), (50, 30, 2, 100), "mixed", LayerGroup(sinks=True)),
    Feature("sinks_decode", (1,) * 5, (1, 17, 64, 300, 1100), "decode", LayerGroup(sinks=True)),
    Feature("sinks_window", (1, 1, 4, 1), (300, 20, 90, 1), "mixed", LayerGroup("window", window=24, sinks=True)),
    Feature("sinks_soft_cap", (1, 30, 1, 4), (50, 30, 2, 100), "mixed", LayerGroup(sinks=True), soft_cap=2.0),
)


def features(caps: Capabilities) -> list[Feature]:
    """What a paged backend declaring `caps` is held to: each mode it serves, every layer-group kind
    and soft-capping (which every paged backend serves), and attention sinks if it declares them."""
    return [f for f in MODES if f.mode in caps.modes] + list(SHAPES) + (list(SINKS) if caps.sinks else [])


@attrs.frozen
class Machine:
    """Where a backend's steps run, at what size, and the bound in units of dtype's roundoff u
    (assert_close_per_request: norm-relative <= units * u per request, elementwise 4x that).

    CPU: small float32 steps (head_dim 16, up to 1,100 keys). Against exact attention a float32
    computation rounds in the logits' D-term dot products, the softmax, and the P @ V sums over the
    keys, each error relative to the logits' size (~1 here): 10.5u at most over 40 seeds of every
    feature, so 32u, still four orders of magnitude below a dropped feature (a soft-cap of 2 ignored:
    0.1-0.4). CUDA: half-precision model-sized steps; the kernels' bound against float32 math (2u, as
    every GPU test), which exact float64 attention changes by ~1e-6 relative, far inside it."""

    device: str
    dtype: torch.dtype
    heads: tuple
    head_dim: int
    page_size: int
    units: float


CPU = Machine("cpu", torch.float32, (4, 2), 16, 4, units=32.0)
CUDA = Machine("cuda", torch.bfloat16, (32, 8), 128, 16, units=2.0)


def check(name: str, feature: Feature, machine: Machine, seed: int) -> None:
    """Backend `name` serves `feature`: its write_kv then run on a committed step match exact attention
    over each request's sequence, per request, within the bounds of machine.dtype (AssertionError naming
    the seed, the backend, the feature and the request otherwise)."""
    backend = load(name)
    spec, plan, cache, q, k_seqs, v_seqs, k_new, v_new = make_step(
        seed, list(feature.q_lens), list(feature.kv_lens), machine.page_size, machine.dtype, groups=(feature.group,),
        soft_cap=feature.soft_cap, heads=machine.heads, head_dim=machine.head_dim, device=machine.device, backend=name,
        write=False)
    context = (f"seed {seed}", name, feature.name)
    assert plan.mode.value == feature.mode and plan.backend == name, (context, plan.mode, plan.backend)
    step = pool_of(spec, max_batch_size=8, max_num_tokens=512, max_num_pages=spec.num_pages, max_pages_per_request=128,
                   device=machine.device).commit(plan)
    sinks = None
    if feature.group.sinks:  # N(0, 3^2) per head: some heads' sinks take most of the softmax, others almost none
        sinks = 3 * torch.randn(spec.num_qo_heads, generator=torch.Generator().manual_seed(seed)).to(machine.device)
    backend.write_kv(step, k_new, v_new, cache)
    out = backend.run(step, q, cache, group=0, k=k_new, v=v_new, sinks=sinks)
    assert out.shape == q.shape and out.dtype == q.dtype, (context, out.shape, out.dtype)
    want = torch.empty(q.shape, dtype=torch.float64, device=machine.device)
    g = feature.group
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        want[a:b] = exact_attention(q[a:b], k_seqs[i], v_seqs[i], scale=spec.sm_scale, soft_cap=feature.soft_cap,
                                    causal=g.causal, window=g.window or 0, sinks=sinks)
    assert_close_per_request(out, want, plan, machine.dtype, context, units=machine.units)

