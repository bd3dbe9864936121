"""metadata/listed.py: build_plan's per-step path of a StepBatch decode step listing exactly its pages, held to the
general path (metadata/plan.py's _plan) on random batches, valid and broken."""

import contextlib

import numpy as np
import pytest

from mstar_attn import CrossRows, LayerGroup, PlanError, build_plan
from mstar_attn.metadata import native
from tests.helpers import fresh_seed, spec_for
from tests.support.decode_batches import decode_batch


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "twin"])
def test_the_listed_decode_path_is_the_general_plan(compiled):
    """build_plan's per-step path for a StepBatch decode step (listed.plan_listed_decode) against the general one
    (plan._plan) on random batches of 1..300 requests, valid and broken: the same plan field for field (array
    dtypes included), or the same PlanError; and the per-step path serves every valid decode step it is for. With
    the compiled builder where it is built (native.py), and with its Python twin (native.disabled())."""
    with contextlib.nullcontext() if compiled else native.disabled():
        _listed_path_is_the_general_plan()


def _listed_path_is_the_general_plan():
    from mstar_attn.metadata import plan as P
    from mstar_attn.metadata.listed import plan_listed_decode

    kinds = ("valid", "valid", "spare", "q2", "kv0", "outside", "short", "shared_written", "past_int32", "wrapped",
             "block_table", "own_list", "csr_extra", "own_missing", "own_short", "own_first", "own_outside", "own_written", "own_spare", "cross_empty",
             "cross_row")
    served = own_served = cross_served = lazy_served = lazy_cross_served = 0
    for _ in range(400):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps = int(rng.choice([1, 4, 16]))
        window = int(rng.integers(1, 40))
        groups = [(LayerGroup(),), (LayerGroup(), LayerGroup("window", window=window)), (LayerGroup("noncausal"),),
                  (LayerGroup(), LayerGroup("window", window=window, own_pages=True)),  # (an own list: own_lists)
                  (LayerGroup(), LayerGroup("cross"))][int(rng.choice(5, p=[0.2, 0.15, 0.15, 0.25, 0.25]))]
        B = int(rng.choice([1, 2, 7, 32, 33, 64, 300]))
        spec = spec_for(page_size=ps, num_pages=B * 7 + 16, groups=groups)
        kind = kinds[int(rng.integers(len(kinds)))]
        step = decode_batch(rng, spec, B, kind)
        for check in (True, False):
            try:
                general = P._plan(step, spec, check, spec.num_pages)
            except PlanError as e:
                general = e
            try:
                fast = build_plan(step, spec, check_ownership=check)
            except PlanError as e:
                fast = e
            where = f"seed {seed}, kind {kind}, B {B}, check_ownership {check}"
            if isinstance(general, PlanError):
                assert isinstance(fast, PlanError) and str(fast) == str(general), where
                continue
            assert not isinstance(fast, PlanError), f"{where}: {fast}"
            assert fast == general and fast.sealed, where
            for name in ("q_lens", "kv_lens", "kv_indices", "slot_mapping", "qo_indptr", "kv_indptr", "kv_last_page_len",
                         "positions"):
                a, b = getattr(fast, name), getattr(general, name)
                assert a.dtype == b.dtype and not a.flags.writeable, f"{where}: {name} {a.dtype} vs {b.dtype}"
            for g, (fg, gg) in enumerate(zip(fast.groups, general.groups)):  # (own lists' arrays: the batch's or gathered)
                for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "kv_start", "slot_mapping"):
                    a, b = getattr(fg, name), getattr(gg, name)
                    assert (a is None) == (b is None), f"{where}: group {g} {name}"
                    assert a is None or (a.dtype == b.dtype and not a.flags.writeable), f"{where}: group {g} {name}"
            exact = np.array_equal(np.diff(step.page_indptr), -(-step.kv_lens // ps))
            taken = plan_listed_decode(step, spec, check) is not None
            assert taken == (exact and (step.q_lens == 1).all() and step.block_table is None), where
            served += taken
            own_served += taken and bool(spec.own_page_groups) and not spec.has_cross
            cross_served += taken and spec.has_cross
            lazy_served += taken and fast.lazy  # (every group on the shared list: a lazy plan, derived on read above)
            lazy_cross = spec.has_cross and isinstance(dict(step.group_pages).get(1), CrossRows) and not (
                dict(step.group_pages)[1].new_lens.any())  # (a cross group of cross-table rows storing nothing: lazy too)
            assert not taken or fast.lazy == (not spec.own_page_groups or lazy_cross), where
            lazy_cross_served += taken and lazy_cross
    assert served > 50 and own_served > 10 and cross_served > 5 and lazy_served > 20 and lazy_cross_served > 3, (
        served, own_served, cross_served, lazy_served, lazy_cross_served)
