"""capture/derive.py on the CPU: a bucketed StepRows step's arrays derived on the device equal what
the host computes for the same step given by pages, padding requests included (their rows too);
and the Triton kernels (under Triton's interpreter, where Triton is installed) equal the torch ops."""

import numpy as np
import pytest
import torch

from mstar_attn import LayerGroup, StepBatch, build_plan
from mstar_attn.capture import derive
from mstar_attn.capture.layout import slot_views
from mstar_attn.kernels.base import PoolStateBase
from mstar_attn.metadata.backends import BACKENDS
from mstar_attn.metadata.batch import StepRows
from tests.capture.test_table import admit, table_pool
from tests.helpers import fresh_seed, pool_of, random_batch, spec_for
from tests.support.derived import check_again, derive_again, interpreted_kernel, staging_on
from tests.support.staged import assert_same_arrays, staged_arrays, step_arrays

GROUPS = (LayerGroup(), LayerGroup("window", window=9), LayerGroup("window", window=40))


def _random_step(seed: int, ps: int, q_len: int):
    """A pool with a page table, and a bucketed decode (q_len 1) or verify step over random rows."""
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=ps, num_pages=3000, groups=GROUPS)
    pool = table_pool(spec, width=160)
    B = int(rng.integers(1, 17))
    kv = rng.integers(q_len + 1, min(300, 140 * ps), B)
    rows, lists = admit(pool, rng, kv, int(rng.integers(0, 3)) if kv.min() - q_len >= 3 * ps else 0)
    q = np.full(B, q_len, np.int32)
    plan = build_plan(StepRows(rows, q, kv) if q_len > 1 else StepRows.decode(rows, kv), spec)
    csr = build_plan(StepBatch.from_pages(q, kv, lists, ps), spec)
    return spec, pool, plan, csr


def random_listed_step(seed: int, ps: int, table: bool = False, sizes: tuple[int, int] = (1, 16)):
    """A CPU pool (with a page table, or without; buckets up to 32) and a bucketed StepBatch decode step of B requests
    (sizes[0] <= B <= sizes[1]) over random pages (sometimes a spare page past what a request reads), which the pool
    derives from its staged lists."""
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=ps, num_pages=3000, groups=GROUPS)
    buckets = (1, 2, 4, 8, 16, 32)
    pool = table_pool(spec, width=160, buckets=buckets) if table else pool_of(
        spec, max_batch_size=32, max_num_tokens=600, max_num_pages=3000, device="cpu", buckets=buckets)
    B = int(rng.integers(sizes[0], sizes[1] + 1))
    kv = rng.integers(1, min(300, 140 * ps), B)
    return spec, pool, build_plan(random_batch(rng, np.ones(B, np.int32), kv, ps, 3000, extra=int(rng.integers(0, 2))), spec)


def _arrays(step):
    """Every array of a committed step, padding rows included: (qo_indptr, per group (kv_indptr,
    last_page_len, kv_lens, first_page, used indices))."""
    out = [step.qo_indptr.numpy().copy()]
    for dg in step.groups:
        n = int(dg.kv_indptr[-1])
        out.append((dg.kv_indptr.numpy().copy(), dg.kv_last_page_len.numpy().copy(), dg.kv_lens.numpy().copy(),
                    dg.first_page.numpy().copy(), dg.kv_indices[:n].numpy().copy()))
    return out


@pytest.mark.parametrize("ps,q_len", [(1, 1), (4, 1), (16, 1), (4, 3), (16, 16)])
def test_derived_arrays_equal_the_host_staged_ones_for_the_same_step(ps, q_len):
    for _ in range(6):
        seed = fresh_seed()
        spec, pool, plan, csr = _random_step(seed, ps, q_len)
        step = pool.commit(plan)
        assert step.bucket is not None and step.padded_batch_size == pool.bucket_for(csr), f"seed {seed}"
        # the same step by pages, as the host stages it, padded
        assert_same_arrays(step_arrays(step), staged_arrays(pool, csr, step.padded_batch_size, q_len), f"seed {seed}")
        got = _arrays(step)
        for g, a in enumerate(got[1:]):  # (first_page: a derived step's array alone)
            kv_start = csr.groups[g].kv_start
            first = np.zeros(plan.batch_size, np.int32) if kv_start is None else kv_start // ps
            assert np.array_equal(a[3][: plan.batch_size], first), f"seed {seed}, group {g}: first_page"
            assert not a[3][plan.batch_size :].any(), f"seed {seed}, group {g}: padding first_page"
        T, N = plan.num_tokens, step.padded_num_tokens
        slots = step.slot_mapping.numpy()
        assert (slots[T:N] // ps == spec.scratch_page).all(), f"seed {seed}: padding rows write the scratch page"


def test_a_negative_control_a_wrong_window_is_caught(monkeypatch):
    """The comparison above sees a derivation that reads one window group as a full one."""
    seed = fresh_seed()
    spec, pool, plan, csr = _random_step(seed, 4, 1)
    while plan.max_kv_len <= 48:
        seed = fresh_seed()
        spec, pool, plan, csr = _random_step(seed, 4, 1)
    monkeypatch.setattr(pool.derivation, "windows", (0, 9, 0))
    got = _arrays(pool.commit(plan))[3]
    B = plan.batch_size
    assert not np.array_equal(got[2][:B], csr.groups[2].kv_lens), f"seed {seed}"


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_listed_decode_steps_derive_what_the_host_stages(ps):
    """A bucketed StepBatch decode step whose groups read the shared list (window groups among them) takes the
    derived commit: it stages its lengths and its page lists alone (the byte count: the head, then one entry per
    listed page and padding request), and the arrays derived from them equal the host staging of the same step,
    padding requests included; pools with a page table and without."""
    for i in range(8):
        seed = fresh_seed()
        spec, pool, plan = random_listed_step(seed, ps, table=i % 2 == 1)
        step = pool.commit(plan)
        R, B = step.padded_batch_size, plan.batch_size
        assert step.bucket is not None, f"seed {seed}"
        assert pool.last_commit_bytes == 4 * (pool.layout.at(R, R).draft + plan.kv_indices.shape[0] + R - B), f"seed {seed}"
        assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, R), f"seed {seed}")


def test_a_window_only_spec_whose_lists_overflow_the_index_region_is_staged_and_right():
    """Every group a window group: a step's whole lists may hold more pages than a slot's index region while each
    group reads few enough. Such a step takes the staged path (its groups' trimmed lists copied); one whose lists fit
    is derived from them (the byte count tells which); both equal the host staging, padding included."""
    for _ in range(6):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        spec = spec_for(page_size=4, num_pages=3000, groups=(LayerGroup("window", window=int(rng.integers(1, 12))),))
        pool = pool_of(spec, max_batch_size=8, max_num_tokens=64, max_num_pages=40, device="cpu", buckets=(1, 2, 4, 8))
        cap = pool.layout.index_capacity
        for long in (True, False):
            B = int(rng.integers(1, 6))
            kv = (rng.integers(4 * cap + 4, 4 * cap + 300, B) if long else rng.integers(1, 4 * cap // 8, B)).astype(np.int32)
            need = -(-kv // 4)
            pages = np.split(rng.permutation(3000)[: int(need.sum())].astype(np.int32), np.cumsum(need)[:-1])
            plan = build_plan(StepBatch.from_pages(np.ones(B, np.int32), kv, pages, 4), spec)
            step = pool.commit(plan)
            R = step.padded_batch_size
            derived = 4 * (pool.layout.at(R, R).draft + plan.kv_indices.shape[0] + R - B)
            assert long == (plan.kv_indices.shape[0] + R - B > cap) and (pool.last_commit_bytes != derived) == long, \
                (f"seed {seed}", long, pool.last_commit_bytes, derived)
            assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, R), (f"seed {seed}", long))


def test_a_negative_control_a_listed_step_with_a_wrong_window_is_caught(monkeypatch):
    """The comparison above sees a derivation of a listed step that reads one window group as a full one."""
    seed = fresh_seed()
    spec, pool, plan = random_listed_step(seed, 4)
    while plan.max_kv_len <= 48:
        seed = fresh_seed()
        spec, pool, plan = random_listed_step(seed, 4)
    monkeypatch.setattr(pool.derivation, "windows", (0, 9, 0))
    step = pool.commit(plan)
    with pytest.raises(AssertionError):
        assert_same_arrays(step_arrays(step), staged_arrays(pool, plan, step.padded_batch_size), f"seed {seed}")


def check_fused_updates(kernel, device: str, seed: int) -> None:
    """The Triton kernel's table updates, derivation and fence against the torch ops (scatter, then derive)
    on the same staging: updates in the rows of the step's requests (pages they read) and in a row outside
    it, the rest of the lanes naming the dump; the fence written, the counter back at 0."""
    rng = np.random.default_rng(seed)
    spec, pool, plan, _ = _random_step(seed, 4, 1)
    step = pool.commit(plan)
    R, s, table = step.padded_batch_size, step.slot, pool.table
    offsets = slot_views(pool.layout, pool.dev[s], pool.host[s], R, step.padded_num_tokens).offsets
    src = pool.host[s].clone()
    at, U, width = offsets.updates, offsets.update_capacity, table.width
    outside = next(r for r in range(table.max_requests) if r not in set(plan.rows.tolist()))
    pos = [int(r) * width + int(c) for r, kv in zip(plan.rows, plan.kv_lens) for c in rng.integers(0, -(-kv // 4), 2)]
    pos = list(dict.fromkeys(pos))[: U - 1] + [outside * width + 3]
    src[at : at + U] = table.dump
    src[at : at + len(pos)] = torch.tensor(pos, dtype=torch.int32)
    src[at + U : at + 2 * U] = torch.from_numpy(rng.integers(0, spec.num_pages, U).astype(np.int32))
    src[offsets.fence] = 12345
    ref_table, ref = table.dev.clone(), pool.dev[s].clone()
    ref[: offsets.draft] = src[: offsets.draft]
    derive.apply_updates(ref_table, ref, offsets)
    d = pool.derivation
    derive.derive_rows(ref, offsets, 1, derive.Derivation(ref_table, width, spec.groups, 4, d.capacity))
    got_table, got = table.dev.clone().to(device), torch.full_like(pool.dev[s], -7).to(device)
    again = derive.Derivation(got_table, width, spec.groups, 4, d.capacity, kernel, pool.num_slots)
    fence = staging_on(torch.zeros(1, dtype=torch.int32), device)
    derive.derive_staged(got, staging_on(src, device), offsets, 1, again, fence, s)
    if device == "cuda":
        torch.cuda.synchronize()
    got, got_table = got.cpu(), got_table.cpu()
    assert torch.equal(got_table[:-1], ref_table[:-1]), f"seed {seed}: the table updates"
    for a, b in ((0, offsets.cross_lens), (offsets.qo, offsets.head_end)):  # (the head the kernel writes, and the rest)
        assert torch.equal(got[a:b], ref[a:b]), f"seed {seed}: buf[{a}:{b}]"
    for dg, o in zip(step.groups, offsets.groups):
        n = int(ref[o.kv_indptr + R])
        assert torch.equal(got[o.indices : o.indices + n], ref[o.indices : o.indices + n]), f"seed {seed}: indices"
    assert int(fence[0]) == 12345 and not again.counters.any(), f"seed {seed}: fence {int(fence[0])}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real: tests/capture/test_derive_gpu.py")
@pytest.mark.parametrize("copy_first", [False, True])
def test_the_triton_kernel_equals_the_torch_ops_under_the_interpreter(copy_first, monkeypatch):
    """copy_first: the kernel reads the head's device copy (derive.COPY_FIRST, here at every size), else the staging."""
    module = interpreted_kernel(monkeypatch, copy_first)

    for ps, q_len in ((1, 1), (4, 1), (16, 1), (4, 5), (16, 16)):
        seed = fresh_seed()
        spec, pool, plan, _ = _random_step(seed, ps, q_len)
        step = pool.commit(plan)  # the torch ops (CPU)
        check_again(pool, step, *derive_again(pool, step, module.derive, "cpu"), seed)
    for ps, sizes in ((1, (1, 16)), (4, (1, 16)), (16, (1, 16)), (4, (17, 32))):  # StepBatch decode steps, from their
        seed = fresh_seed()                                                       # staged lists (past 16 requests too)
        spec, pool, plan = random_listed_step(seed, ps, table=ps == 4, sizes=sizes)
        step = pool.commit(plan)  # the torch ops (CPU)
        check_again(pool, step, *derive_again(pool, step, module.derive, "cpu"), seed)
    for _ in range(3):
        check_fused_updates(module.derive, "cpu", fresh_seed())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real: tests/capture/test_derive_gpu.py")
def test_the_triton_derivation_of_token_tree_steps_past_16_tokens_equals_the_torch_ops():
    """Bucketed StepRows tree steps of 17..64 tokens per request (a pool of max_tree_nodes=64, causal groups):
    the Triton kernel under the interpreter derives the same head and slots as the torch ops (every token's
    slot, not the first 16 of each request)."""
    pytest.importorskip("triton")
    from mstar_attn import DraftTree, build_tree_plan
    from mstar_attn.capture import _derive_triton as module

    for q_len in (17, 40, 64):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        spec = spec_for(page_size=4, num_pages=3000)
        pool = table_pool(spec, width=160, buckets=(1, 2, 4, 8), max_tree_nodes=64)
        B = int(rng.integers(1, 9))
        kv = rng.integers(q_len + 1, 500, B)
        rows, _ = admit(pool, rng, kv)
        tree = DraftTree.from_parents([[-1] + list(range(q_len - 1))] * B)
        plan = build_tree_plan(StepRows(rows, np.full(B, q_len, np.int32), kv), spec, tree)
        step = pool.commit(plan)  # the torch ops (CPU)
        assert step.bucket is not None, (f"seed {seed}", q_len, B)
        buf, offsets = derive_again(pool, step, module.derive, "cpu")
        N = step.padded_num_tokens
        assert torch.equal(buf[: offsets.updates], pool.dev[step.slot][: offsets.updates]), f"seed {seed}"
        assert torch.equal(buf[offsets.qo : offsets.head_end], pool.dev[step.slot][offsets.qo : offsets.head_end]), f"seed {seed}"
        slots = buf[offsets.slots : offsets.slots + 2 * N].view(torch.int64)
        assert torch.equal(slots, step.slot_mapping[:N]), (f"seed {seed}", q_len)


def test_derived_steps_stay_right_when_other_steps_write_the_slot_between():
    """One slot: derived decode steps (the same rows again, new lengths, rows reordered, a page assigned)
    with an unbucketed StepRows step and a StepBatch step committed into the slot between them; each
    derived step's arrays against the same step by pages, staged on the host."""
    for _ in range(4):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
        pool = table_pool(spec, width=160, num_slots=1)
        B = int(rng.integers(2, 9))
        kv = rng.integers(10, 200, B).astype(np.int32)
        rows, _ = admit(pool, rng, kv + 8)  # (room for the walk below)
        free = iter(rng.permutation(np.flatnonzero(pool.table.owner[:-1] == -1)).astype(np.int32))

        def derived(rows, kv, label):
            pages = [pool.table.pages(int(r))[: -(-int(k) // 4)] for r, k in zip(rows, kv)]
            csr = build_plan(StepBatch.from_pages(np.ones(len(rows), np.int32), kv, pages, 4), spec)
            step = pool.commit(build_plan(StepRows.decode(rows, kv), spec))
            assert step.bucket is not None, (seed, label)
            assert_same_arrays(step_arrays(step), staged_arrays(pool, csr, step.padded_batch_size), (seed, label))

        derived(rows, kv, "first")
        derived(rows, kv, "the same step again")
        derived(rows, kv + 1, "new lengths")
        q = np.ones(B, np.int32)
        q[0] = 3
        pool.commit(build_plan(StepRows(rows, q, kv + 3), spec))  # (mixed: unbucketed, staged on the host)
        derived(rows, kv + 2, "after an unbucketed StepRows step")
        pool.table.assign(int(rows[-1]), [next(free)])
        derived(rows, kv + 3, "after a page was assigned")
        derived(rows, kv + 3, "the same again, no updates")
        order = rng.permutation(B)
        order[:2] = order[1::-1] if order[0] < order[1] else order[:2]  # (never the same order)
        derived(rows[order], (kv + 3)[order], "rows reordered")
        n = B + 3  # (more requests than the rows' step: the head's lengths past B are the StepBatch step's)
        other = build_plan(StepBatch.from_pages(np.ones(n, np.int32), [3] * n, [[next(free)] for _ in range(n)], 4), spec)
        assert_same_arrays(step_arrays(pool.commit(other)), staged_arrays(pool, other, pool.bucket_for(other)), seed)
        derived(rows, kv + 4, "after a StepBatch step")
        derived(rows, kv + 5, "the next one")


class _LazyPoolState(PoolStateBase):
    """A backend state that reads no host array (as FlashInfer's fixed schedule, or FA4): lazy_host_arrays."""

    lazy_host_arrays = True

    def schedule(self, step):
        return (None,) * len(step.groups)


def test_a_derived_commit_derives_no_plan_array_on_the_host():
    for ps, q_len in ((4, 1), (16, 1)):
        seed = fresh_seed()
        spec, pool, plan, _ = _random_step(seed, ps, q_len)
        pool.backend_states[BACKENDS[plan.backend].module] = _LazyPoolState()
        step = pool.commit(plan)
        assert step.bucket is not None and not plan.arrays_derived, seed
        pool.stage_host(step)  # (what a backend state that plans from host arrays asks for)
        assert plan.arrays_derived, seed


def test_derived_steps_over_two_slots_with_verify_steps_and_page_churn():
    """Two slots: decode and verify steps over the same rows (the staged head's q_len differs), and a
    row's pages from the one the step writes on replaced between steps (table updates landing in one
    slot, then the other); each derived step's arrays and slot_mapping against the same step by pages."""
    for _ in range(4):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        spec = spec_for(page_size=4, num_pages=3000, groups=GROUPS)
        pool = table_pool(spec, width=160)
        B = int(rng.choice([3, 5, 6, 7]))  # (bucket padding: the padding rows' q_len is staged too)
        kv = rng.integers(10, 200, B).astype(np.int32)
        rows, _ = admit(pool, rng, kv + 40)
        free = iter(rng.permutation(np.flatnonzero(pool.table.owner[:-1] == -1)).astype(np.int32))
        def step(i, churn, q_len):
            nonlocal kv
            kv = kv + 1
            if churn is not None:  # the row's pages from the one this step writes on replaced by others
                c, need = int(pool.table.counts[rows[churn]]), -(-int(kv[churn]) // 4)
                pool.table.release(int(rows[churn]), keep=need - 1)
                pool.table.assign(int(rows[churn]), [next(free) for _ in range(c - need + 1)])
            q = np.full(B, q_len, np.int32)
            plan = build_plan(StepRows.decode(rows, kv) if q_len == 1 else StepRows(rows, q, kv), spec)
            pages = [pool.table.pages(int(r))[: -(-int(k) // 4)] for r, k in zip(rows, kv)]
            csr = build_plan(StepBatch.from_pages(q, kv, pages, 4), spec)
            step = pool.commit(plan)
            assert step.bucket is not None, (seed, i)
            assert_same_arrays(step_arrays(step), staged_arrays(pool, csr, step.padded_batch_size, q_len), (seed, i))

        for i in range(16):
            step(i, int(rng.integers(B)) if rng.random() < 0.4 else None, int(rng.choice([1, 3])))
        for i, churn in enumerate((0, 0, None, None)):  # an entry changed in one slot, then the other; then no change
            step(16 + i, churn, 1)
        for i, q_len in enumerate((3, 3, 1, 1)):  # the same rows at another q_len in each slot
            step(20 + i, None, q_len)
