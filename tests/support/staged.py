"""The host twin of a bucketed step's device arrays: what `stage_pages` (the pure host staging of a step that lists
its pages) writes for a plan, read back as the arrays a committed step's device views hold (CPU pools)."""

from __future__ import annotations

import numpy as np
import torch

from mstar_attn.capture.stage import stage_pages


def staged_arrays(pool, plan, rows: int, q_len: int = 1) -> dict:
    """`plan` (a plan that lists its pages) padded to `rows` requests of q_len tokens each, as stage_pages writes it
    into a fresh host buffer of `pool`'s layout: qo [rows+1], slots [rows * q_len] int64, and per group (kv_indptr
    [rows+1], last_page_len [rows], kv_lens [rows], the used indices) (numpy). A cross group naming cross-table rows
    (CrossRows): its indices are those rows' pages in the pool's cross table (its host mirror), as the device gathers."""
    N = rows * q_len
    offsets = pool.layout.at(rows, N)
    h = np.full(pool.layout.size, -7, np.int32)  # (never a value a step holds)
    stage_pages(h, plan, offsets, rows, q_len, N, pool.scratch_slots)
    for gp, o in zip(plan.groups, offsets.groups):
        if gp.table_rows is not None:  # CrossRows: the pages the device gathers from the rows of the pool's cross table
            t, ps = pool.cross_table, plan.spec.page_size
            named = [*gp.table_rows.tolist(), *[t.scratch_row] * (rows - plan.batch_size)]
            lens = h[o.kv_lens : o.kv_lens + rows].tolist()
            got = np.concatenate([t.flat[r * t.width : r * t.width + -(-k // ps)] for r, k in zip(named, lens)])
            h[o.indices : o.indices + got.shape[0]] = got
    groups = []
    for o in offsets.groups:
        indptr = h[o.kv_indptr : o.kv_indptr + rows + 1]
        groups.append((indptr, h[o.last_page_len : o.last_page_len + rows], h[o.kv_lens : o.kv_lens + rows],
                       h[o.indices : o.indices + indptr[-1]]))
    return dict(qo=h[offsets.qo : offsets.qo + rows + 1], slots=h[offsets.slots : offsets.slots + 2 * N].view(np.int64),
                groups=groups, tokens=plan.num_tokens, scratch=(plan.spec.scratch_page, plan.spec.page_size))


def step_arrays(step) -> dict:
    """The same arrays of a committed step (CPU), read from its device views, padding requests included."""
    R, N = step.padded_batch_size, step.padded_num_tokens
    groups = [(dg.kv_indptr.numpy()[: R + 1], dg.kv_last_page_len.numpy()[:R], dg.kv_lens.numpy()[:R],
               dg.kv_indices.numpy()[: int(dg.kv_indptr[R])]) for dg in step.groups]
    return dict(qo=step.qo_indptr.numpy()[: R + 1], slots=step.slot_mapping.numpy()[:N], groups=groups)


def assert_same_arrays(got: dict, want: dict, context) -> None:
    """Every array equal (`got` from step_arrays, `want` from staged_arrays), the first difference named with
    `context`; padding token rows may write any slot of the scratch page."""
    assert np.array_equal(got["qo"], want["qo"]), (context, "qo_indptr", got["qo"], want["qo"])
    T, (scratch, ps) = want["tokens"], want["scratch"]
    assert np.array_equal(got["slots"][:T], want["slots"][:T]), (context, "slot_mapping", got["slots"], want["slots"])
    assert got["slots"].shape == want["slots"].shape and (got["slots"][T:] // ps == scratch).all(), (context, got["slots"])
    for g, (a, b) in enumerate(zip(got["groups"], want["groups"], strict=True)):
        for name, x, y in zip(("kv_indptr", "last_page_len", "kv_lens", "indices"), a, b):
            assert np.array_equal(x, y), (context, f"group {g}", name, x, y)


def pool_state(pool) -> tuple:
    """What a commit may change of a pool with a page table: generations, next slot, steady records and commits, the
    slots' staging, the table's mirror and pending updates, the deferred work, the bytes sent (copies)."""
    t = pool.table
    return (list(pool.generations), pool.next_slot, pool.steady.commits, list(pool.steady.records),
            [h.copy() for h in pool.host_np], t.flat.copy(), t.counts.copy(), t.owner.copy(), t.changes,
            list(pool.device_work.pending), pool.bytes_to_device, t.pending)


def assert_same_state(before, after, label) -> None:
    """Two pool_state snapshots equal field by field (a refused commit changed nothing)."""
    for x, y in zip(before, after):
        if isinstance(x, list):
            assert len(x) == len(y) and all(a is b or np.array_equal(a, b) for a, b in zip(x, y)), label
        else:
            assert np.array_equal(x, y), label


def assert_same_outputs(steps: tuple, caches: tuple, gen, label) -> None:
    """Two committed steps of the same plan (CPU pools, the reference backend), each over its own cache: the same
    random K/V written and the same random queries attended in every group give the same caches and, request by
    request, the same outputs. gen: the torch.Generator drawing k, v, q."""
    from mstar_attn.kernels import reference

    spec, B = steps[0].plan.spec, steps[0].plan.batch_size
    H, Hkv, D = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    k, v, q = (torch.randn(B, n, D, generator=gen) for n in (Hkv, Hkv, H))
    outs = []
    for step, c in zip(steps, caches):
        reference.write_kv(step, k, v, c, 0)
        outs.append([reference.run(step, q, c, group=g) for g in range(len(spec.groups))])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v), label
    for g, (x, y) in enumerate(zip(*outs)):
        for r in range(B):
            assert torch.equal(x[r], y[r]), (label, g, r)


def steady_step(pool, plan, label, defer: bool = True, prepare: bool = True) -> int:
    """Commit `plan` into a CPU pool (defer: with defer=True), run its device work (prepare) and hold its arrays to the
    host staging of the same plan; returns the steady commits it took (0 or 1)."""
    n0 = pool.steady.commits
    st = pool.commit(plan, defer=defer)
    if prepare:
        st.prepare()
        assert_same_arrays(step_arrays(st), staged_arrays(pool, plan, st.padded_batch_size), label)
    return pool.steady.commits - n0
