"""Cross-attention groups over the pool's cross table (capture/cross.py): encoder pages assigned to
rows once, steps naming rows, page lists gathered on the device; what commits copy; the refusals."""

import attrs
import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, CrossRows, PlanError, PoolLimits, StepBatch, build_plan
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from tests.support.cross_pages import GROUPS, CrossTrace, serve
from tests.helpers import fresh_seed, pool_of, random_cache


def cpu_pool(spec, **kw):
    return pool_of(spec, max_batch_size=32, max_num_tokens=1024, max_num_pages=spec.num_pages, device="cpu",
                   buckets=(1, 4, 8), max_requests=64, max_pages_per_request=kw.pop("width", 256), **kw)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_the_reference_over_cross_rows_matches_the_exact_attention(page_size):
    seed = fresh_seed()
    spec = AttentionSpec(4, 2, 16, page_size, 12000, dtype=torch.float32, groups=GROUPS, layer_groups=(0, 1),
                         backend="reference")
    pool = cpu_pool(spec, width=12000 // page_size, max_encoder_tokens=8000)
    trace = CrossTrace(spec, seed, max_batch=6, max_encoder=1500, table=pool.cross_table)
    caches = [attrs.evolve(random_cache(spec, seed + g, device="cpu"), group=g) for g in range(2)]
    ran = serve(trace, pool, reference, caches, 15, seed)
    assert any(stored for *_, stored in ran) and ran.get(("decode", False, False)), (f"seed {seed}", ran)


def _decode(pool, enc_lens, write=False):
    """Commit a decode step of len(enc_lens) requests (rows 0..) whose encoders have these lengths."""
    spec, B, table = pool.spec, len(enc_lens), pool.cross_table
    for r, n in enumerate(enc_lens):
        if table.counts[r] == 0:
            table.assign(r, list(range(1000 * r, 1000 * r + -(-n // spec.page_size))))
    batch = StepBatch.from_pages([1] * B, [5] * B, [[i] for i in range(B)], spec.page_size,
                                 group_pages={1: CrossRows.of(range(B), enc_lens, [write] * B)})
    return pool.commit(build_plan(batch, spec))


def test_decode_steps_copy_no_cross_page_ids():
    """The bytes a decode step copies depend neither on the encoder lengths nor on the pool's
    max_encoder_tokens; the first step (storing the encoders) also sends the rows' new table entries
    and the encoder tokens' slots. The device page list holds the rows' pages either way."""
    spec = AttentionSpec(4, 2, 16, 16, 8000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pools = {"short": cpu_pool(spec, max_encoder_tokens=9000), "long": cpu_pool(spec, max_encoder_tokens=9000),
             "long, room for 64k": cpu_pool(spec, max_encoder_tokens=65536)}
    lens = {"short": [10] * 3, "long": [3000] * 3, "long, room for 64k": [3000] * 3}
    first = {k: (_decode(p, lens[k], write=True), p.last_commit_bytes)[1] for k, p in pools.items()}
    again = {}
    for k, p in pools.items():
        step = _decode(p, lens[k])
        again[k] = p.last_commit_bytes
        gp, n = step.plan.groups[1], -(-lens[k][0] // 16)
        got = step.groups[1].kv_indices[: gp.kv_indptr[-1]].numpy()
        assert np.array_equal(got, np.concatenate([np.arange(1000 * r, 1000 * r + n) for r in range(3)]))
    assert len(set(again.values())) == 1, again  # 3,000-token encoders cost what 10-token ones do
    # the first step: 3 x 1 new entries fit the step's update region (copied every step), 3 x 188 went
    # directly, 12 bytes each (int64 position + int32 page); and 8 bytes of slot per encoder token stored
    assert first["long"] - first["short"] == 12 * 3 * 188 + 8 * 3 * (3000 - 10), first
    assert first["long"] == first["long, room for 64k"], first


def test_cross_rows_are_checked_at_commit_and_a_failed_commit_keeps_the_table_updates():
    spec = AttentionSpec(4, 2, 16, 16, 8000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    pool = cpu_pool(spec)
    table = pool.cross_table
    table.assign(0, [1, 2])
    table.assign(1, [3, 4])
    table.assign(2, [7], shared=True)
    table.assign(3, [9])

    def commit(rows, lens, write=None):
        batch = StepBatch.from_pages([1] * len(rows), [5] * len(rows), [[40 + i] for i in range(len(rows))], 16,
                                     group_pages={1: CrossRows.of(rows, lens, write)})
        return pool.commit(build_plan(batch, spec))

    assert commit([0, 1], [20, 30], [True, True]).plan.groups[1].stored == 50  # their encoders, stored once
    assert table.stored[[0, 1]].tolist() == [20, 30]
    table.assign(4, [11])
    pending = table.pending
    for rows, lens, write, match in [
        ([0, 64], [20, 5], None, r"group_pages\[1\]\.rows\[1\]: row 64 is not a cross-table row"),
        ([0, 1], [20, 40], None, r"group_pages\[1\]\.rows\[1\]: row 1 holds 2 pages, fewer than encoder length 40 needs"),
        ([3, 3], [10, 10], [True, True], r"two requests store their encoder K/V into the same cross-table row"),
        ([2], [10], [True], r"row 2 would store encoder K/V into page 7, but shares it read-only"),
        ([1, 3], [30, 10], None, r"kv_lens\[1\]: the step reads 10 encoder tokens of row 3, which holds none stored yet"),
        ([0], [10], None, r"kv_lens\[0\]: the step reads 10 encoder tokens of row 0, which holds 20 stored"),
    ]:
        with pytest.raises(PlanError, match=match):
            commit(rows, lens, write)
        assert table.pending == pending  # nothing taken
    step = commit([0, 0, 1], [20, 20, 30])  # two requests reading one encoder (parallel samples) is fine
    # (a derived decode step: row 4's update, in a row it does not read, stays pending for a commit that sends it)
    assert table.pending == pending and step.plan.groups[1].stored == 0
    commit([4], [16], [True])  # (a step storing into row 4: staged, it sends the update first)
    assert table.pending == 0
    table.release(0)
    with pytest.raises(PlanError, match="holds none stored yet"):  # a released row holds nothing
        table.assign(0, [1, 2]) or commit([0], [20])
    plain = GraphBufferPool(spec, PoolLimits(max_batch_size=4, max_num_tokens=64, max_num_pages=8000), device="cpu")
    assert plain.cross_table is None
    rows_batch = StepBatch.from_pages([1], [5], [[0]], 16, group_pages={1: CrossRows.of([0], [5])})
    with pytest.raises(PlanError, match="this pool has no cross table"):
        plain.commit(build_plan(rows_batch, spec))
    with pytest.raises(PlanError, match="StepRows plan names no pages"):
        reference.run(build_plan(rows_batch, spec), torch.ones(1, 4, 16), random_cache(spec, 0, device="cpu"), group=1)
    two = AttentionSpec(4, 2, 16, 16, 8000, groups=(*GROUPS, GROUPS[1]), layer_groups=(0, 1, 2), backend="reference")
    with pytest.raises(PlanError, match="one cross-attention group per step may name cross-table rows"):
        build_plan(StepBatch.from_pages([1], [5], [[0]], 16, group_pages={1: CrossRows.of([0], [5]), 2: CrossRows.of([0], [5])}),
                   two)


def test_the_short_check_decides_as_the_numpy_check(monkeypatch):
    """cross.check of a step storing nothing, over at most SHORT requests (Python ints), accepts and refuses exactly
    what its numpy path does, with the same PlanError: rows past the table, rows short of pages, lengths other than
    the stored ones, rows never stored."""
    from mstar_attn.capture import cross

    spec = AttentionSpec(4, 2, 16, 4, 8000, groups=GROUPS, layer_groups=(0, 1), backend="reference", dtype=torch.float32)
    for _ in range(30):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        table = cpu_pool(spec).cross_table
        stored = {}
        for r in range(40):  # 40 rows assigned, 30 of them stored
            n = int(rng.integers(1, 60))
            table.assign(r, list(range(100 * r, 100 * r + -(-n // 4))))
            if r < 30:
                table.stored[r] = stored[r] = n
        for _ in range(40):
            B = int(rng.integers(1, cross.SHORT + 9))  # (both sides of the short path's bound)
            rows = rng.integers(0, 30, B)
            lens = np.array([stored[int(r)] for r in rows])
            fault, i = int(rng.integers(0, 6)), int(rng.integers(0, B))
            if fault == 2:
                rows[i] = int(rng.choice([64, 65, 1000]))  # past the table's 64 rows (or its scratch row)
            elif fault == 3:
                lens[i] += int(rng.integers(1, 8))  # other than stored (and maybe past its pages)
            elif fault == 4:
                rows[i] = int(rng.integers(30, 40))  # assigned, never stored
            elif fault == 5:
                lens[i] = lens[i] - 1 if lens[i] > 1 else 2  # other than stored
            batch = StepBatch.from_pages([1] * B, [1] * B, [[j] for j in range(B)], 4,
                                         group_pages={1: CrossRows.of(rows, lens)})
            plan = build_plan(batch, spec)

            def outcome(short):
                monkeypatch.setattr(cross, "SHORT", short)
                try:
                    return cross.check(table, plan, 1).tolist()
                except PlanError as e:
                    return str(e)

            a, b = outcome(cross.SHORT), outcome(0)
            monkeypatch.undo()
            assert a == b, (seed, fault, a, b)
            assert (a == []) == (fault in (0, 1)), (seed, fault, a)
