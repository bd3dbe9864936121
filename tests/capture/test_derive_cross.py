"""capture/derive.py's cross groups on the CPU: a bucketed encoder-decoder decode step (a self group on the shared
list beside a cross group naming cross-table rows, CrossRows, storing nothing) takes the derived commit, and the
arrays derived from its staged lists, rows and encoder lengths equal the host staging of the same step with those
rows' pages, padding requests included; the Triton kernel (under the interpreter) equals the torch ops; the steps
the derivation does not serve are staged, and right."""

import types

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, CrossRows, StepBatch, build_plan
from mstar_attn.capture import cross
from mstar_attn.capture.stage import listed_entries
from mstar_attn.capture.table import FREE
from tests.helpers import fresh_seed, pool_of
from tests.support.cross_pages import GROUPS
from tests.support.derived import check_again, derive_again, interpreted_kernel
from tests.support.staged import assert_same_arrays, staged_arrays, step_arrays


def random_cross_step(seed: int, ps: int, sizes: tuple[int, int] = (1, 16)):
    """A CPU pool with a cross table (buckets up to 32) and B requests (sizes[0] <= B <= sizes[1]) whose encoder pages
    fill random cross-table rows, stored by a first step (committed); returns (spec, pool, the next decode step's
    plan, its batch's parts (q, kv, lists, rows, encoder lengths)). Its lists are exactly its pages, or one spare page
    past them (the general path's plan)."""
    rng = np.random.default_rng(seed)
    spec = AttentionSpec(4, 2, 16, ps, 3000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pool = pool_of(spec, max_batch_size=32, max_num_tokens=600, max_num_pages=3000, device="cpu",
                   buckets=(1, 2, 4, 8, 16, 32), max_requests=64, max_pages_per_request=200, max_encoder_tokens=6000)
    B = int(rng.integers(sizes[0], sizes[1] + 1))
    rows = rng.permutation(64)[:B].astype(np.int32)
    enc = rng.integers(1, min(180, 150 * ps) + 1, B).astype(np.int32)
    cross_pages, at = rng.permutation(3000), 0
    for r, n in zip(rows.tolist(), enc.tolist()):
        pool.cross_table.assign(r, cross_pages[at : at + -(-n // ps)].tolist())
        at += -(-n // ps)
    kv = rng.integers(1, min(300, 140 * ps), B).astype(np.int32)
    own, at, held = rng.permutation(3000), 0, []
    for k in kv.tolist():
        held.append(own[at : at + -(-(k + 1) // ps) + 1].tolist())  # (room for the next step's token, and a spare)
        at += len(held[-1])
    q = np.ones(B, np.int32)

    def batch(lens, write: bool, spare: bool = False):
        lists = [h[: -(-int(k) // ps) + spare] for h, k in zip(held, lens)]
        return StepBatch.from_pages(q, lens, lists, ps, group_pages={1: CrossRows.of(rows, enc, [write] * B)})

    pool.commit(build_plan(batch(kv, True), spec))  # (stores the encoder K/V: staged)
    plan = build_plan(batch(kv + 1, False, bool(rng.integers(0, 2))), spec)
    return spec, pool, plan


def derived_bytes(pool, plan, R: int) -> int:
    """What a derived listed commit copies: the head, then its lists and one scratch page per padding request."""
    return 4 * (pool.layout.at(R, R).draft + listed_entries(plan, R))


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_cross_decode_steps_derive_what_the_host_stages(ps):
    """The derived commit (its byte count: the head and the lists alone, no cross page id) gives the arrays of the
    host staging of the same step, the cross group's pages those of its rows in the cross table."""
    for _ in range(8):
        seed = fresh_seed()
        spec, pool, plan = random_cross_step(seed, ps, sizes=(1, 32))
        step = pool.commit(plan)
        R = step.padded_batch_size
        assert step.bucket is not None and pool.last_commit_bytes == derived_bytes(pool, plan, R), f"seed {seed}"
        assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, R), f"seed {seed}")


def test_steps_the_derivation_does_not_serve_are_staged_and_right():
    """A step storing encoder K/V, one reading a cross-table row with an update pending (a page appended to it), and
    a backend state whose schedule reads the step's device rows (FA4's dense tables) take the staged commit, which
    sends the update; an update pending in a row the step does not read (a row assigned) leaves it derived, the
    update still pending. Every step gives the host staging's arrays."""
    for _ in range(4):
        seed = fresh_seed()
        spec, pool, plan = random_cross_step(seed, 4)
        R, gp, table = pool.bucket_for(plan), plan.group_plan(1), pool.cross_table
        storing = build_plan(StepBatch.from_pages(plan.q_lens, plan.kv_lens, np.split(plan.kv_indices, plan.kv_indptr[1:-1]),
                                                  4, group_pages={1: CrossRows.of(gp.table_rows, gp.kv_lens,
                                                                                  [True] * plan.batch_size)}), spec)
        assert not cross.derivable(storing, 1, table, None), f"seed {seed}"
        assert not cross.derivable(plan, 1, table, types.SimpleNamespace(schedule_reads_rows=True)), f"seed {seed}"
        free = list(np.flatnonzero(table.owner[:3000] == FREE))
        table.assign(next(r for r in range(64) if table.counts[r] == 0), [int(free.pop())])  # (a row the step does not read)
        step = pool.commit(plan)
        assert pool.last_commit_bytes == derived_bytes(pool, plan, R) and table.pending, f"seed {seed}: derived, pending"
        assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, R), f"seed {seed}")
        table.append(np.array([gp.table_rows[0]], np.int32), [int(free.pop())])  # (a row the step reads)
        assert not cross.derivable(plan, 1, table, None), f"seed {seed}"
        step = pool.commit(plan)
        assert pool.last_commit_bytes != derived_bytes(pool, plan, R) and not table.pending, f"seed {seed}: staged, sent"
        assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, R), f"seed {seed}")
        assert cross.derivable(plan, 1, table, None), f"seed {seed}: nothing pending now"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel runs for real: tests/capture/test_derive_gpu.py")
@pytest.mark.parametrize("copy_first", [False, True])
def test_the_triton_kernel_derives_cross_steps_as_the_torch_ops_under_the_interpreter(copy_first, monkeypatch):
    module = interpreted_kernel(monkeypatch, copy_first)

    for ps, sizes in ((1, (1, 16)), (4, (1, 16)), (16, (1, 16)), (4, (17, 32))):
        seed = fresh_seed()
        spec, pool, plan = random_cross_step(seed, ps, sizes)
        step = pool.commit(plan)  # the torch ops (CPU)
        check_again(pool, step, *derive_again(pool, step, module.derive, "cpu"), seed)


def test_a_negative_control_a_cross_group_read_as_a_self_group_is_caught(monkeypatch):
    """The comparisons above see a derivation that takes the cross group's pages from the step's own lists."""
    seed = fresh_seed()
    spec, pool, plan = random_cross_step(seed, 4)
    step = pool.commit(plan)
    monkeypatch.setattr(pool.derivation, "cross", None)
    with pytest.raises(AssertionError):
        check_again(pool, step, *derive_again(pool, step, None, "cpu"), seed)
