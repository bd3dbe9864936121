"""Every paged backend this machine can run, every feature it declares, one step each, every request
against exact attention (tests/support/conformance.py). On a CPU-only machine that is the reference
backend; with CUDA and the GPU extras, FlashInfer and FlashAttention-4 too. A backend that declares
a feature and ignores it fails the suite: ones injected here that drop the soft-cap or the attention
sinks are caught."""

from __future__ import annotations

import importlib.util
import sys
import types

import attrs
import pytest
import torch

from mstar_attn import StepBatch, build_plan
from mstar_attn.kernels import reference
from mstar_attn.metadata.backends import BACKENDS, Capabilities
from tests.helpers import fresh_seed
from tests.support.conformance import CPU, CUDA, check, features


def _runnable(name: str) -> bool:
    caps = BACKENDS[name]
    if caps.prefix_free or caps.mla_only:  # (no paged cache to conform with: the dense and latent paths)
        return False
    if caps.package is None:
        return True
    return torch.cuda.is_available() and importlib.util.find_spec(caps.package.split(".")[0]) is not None


CASES = [pytest.param(name, f, id=f"{name}-{f.name}", marks=[pytest.mark.gpu] if BACKENDS[name].package else [])
         for name in BACKENDS if _runnable(name) for f in features(BACKENDS[name])]


@pytest.mark.parametrize("name, feature", CASES)
def test_every_backend_serves_every_feature_it_declares(name, feature):
    check(name, feature, CUDA if BACKENDS[name].package else CPU, fresh_seed())


def _reference_as_if(step, q, cache, sinks=None, **spec_changes):
    """The reference over the step's pages, planned for the step's spec with spec_changes: a backend that
    ignores what the changes drop."""
    plan = step.plan
    spec = attrs.evolve(plan.spec, backend="reference", **spec_changes)
    batch = StepBatch.from_csr(plan.q_lens, plan.kv_lens, plan.kv_indptr, plan.kv_indices, spec.page_size)
    return reference.run(build_plan(batch, spec), q, cache, sinks=sinks)


def _drops_soft_cap(step, q, cache, group=None, k=None, v=None, sinks=None):
    """A backend's run that ignores the spec's soft-cap."""
    return _reference_as_if(step, q, cache, sinks, soft_cap=0.0)


def _drops_sinks(step, q, cache, group=None, k=None, v=None, sinks=None):
    """A backend's run that ignores the layer's attention sinks."""
    return _reference_as_if(step, q, cache, groups=tuple(attrs.evolve(g, sinks=False) for g in step.plan.spec.groups))


@pytest.mark.parametrize("run, dropped", [(_drops_soft_cap, ["soft_cap", "sinks_soft_cap"]),
                                          (_drops_sinks, ["sinks", "sinks_decode", "sinks_window", "sinks_soft_cap"])])
def test_a_backend_that_ignores_a_declared_feature_fails_the_suite(monkeypatch, run, dropped):
    """A backend registered beside the others, declaring what the reference declares (attention sinks
    included), whose run drops the soft-cap, or the sinks: the suite's steps of that feature fail, and
    only those."""
    fake = types.ModuleType("tests_fake_backend")
    fake.write_kv, fake.run = reference.write_kv, run
    monkeypatch.setitem(sys.modules, "tests_fake_backend", fake)
    monkeypatch.setitem(BACKENDS, "fake", Capabilities("tests_fake_backend", BACKENDS["reference"].dtypes, sinks=True))
    seed = fresh_seed()
    failed = []
    for feature in features(BACKENDS["fake"]):
        try:
            check("fake", feature, CPU, seed)
        except AssertionError:
            failed.append(feature.name)
    assert failed == dropped, (f"seed {seed}", failed)
