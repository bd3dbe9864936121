"""GraphBufferPool's bookkeeping on the CPU: what lands in the device buffers, how many bytes a commit
copies, bounded state, stale steps, all-or-nothing commits. (A CPU pool's copies are synchronous,
so its events are always done; the reference backend keeps no PoolState.)"""

import numpy as np
import pytest
import torch

from mstar_attn import AttentionSpec, LayerGroup, PagedKVCache, PlanError, PoolLimits, StaleStepError, build_plan, kernels
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.kernels import reference
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN, scratch_plan
from tests.helpers import fresh_seed, pool_of, random_batch, spec_for

GROUPS = (LayerGroup(), LayerGroup("window", window=9))


def pool_for(spec, **kw):
    kw.setdefault("max_batch_size", 64)
    kw.setdefault("max_num_tokens", 512)
    kw.setdefault("max_num_pages", spec.num_pages)
    kw.setdefault("buckets", (1, 2, 4, 8, 16))
    return pool_of(spec, device="cpu", **kw)


def device_arrays(step):
    """What the step's device views hold, as numpy."""
    return dict(qo=step.qo_indptr.numpy(), slots=step.slot_mapping.numpy(),
                groups=[(g.kv_indptr.numpy(), g.kv_indices.numpy(), g.kv_last_page_len.numpy(), g.kv_lens.numpy())
                        for g in step.groups])


@pytest.mark.parametrize("q, kv", [([1] * 5, [3, 17, 30, 1, 9]), ([4] * 3, [5, 22, 40]), ([3, 9], [3, 30]),
                                   ([1] * 20, list(range(1, 21)))], ids=["decode", "verify", "prefill", "decode-past-buckets"])
def test_device_buffers_hold_the_plan_and_padding_reads_the_scratch_page(q, kv):
    seed = fresh_seed()
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS)
    plan = build_plan(random_batch(np.random.default_rng(seed), q, kv, 4, 200, extra=1), spec)
    pool = pool_for(spec)
    step = pool.commit(plan)
    pool.stage_host(step)  # (a derived decode step's pinned arrays, which dg.listed() reads: staged on request)
    got = device_arrays(step)
    B, T = plan.batch_size, plan.num_tokens
    bucket = pool.bucket_for(plan)
    assert step.bucket == bucket and step.padded_batch_size == (bucket or B)
    assert np.array_equal(got["qo"][: B + 1], plan.qo_indptr) and np.array_equal(got["slots"][:T], plan.slot_mapping)
    for (indptr, indices, lpl, lens), gp, dg in zip(got["groups"], plan.groups, step.groups):
        n = gp.kv_indices.shape[0]
        assert np.array_equal(indptr[: B + 1], gp.kv_indptr) and np.array_equal(indices[:n], gp.kv_indices)
        assert np.array_equal(lpl[:B], gp.kv_last_page_len) and np.array_equal(lens[:B], gp.kv_lens)
        pad = step.padded_batch_size - B  # padding requests: q_len tokens of the scratch page, nothing else
        m = n + pad * -(-step.q_len // 4)  # the step's entries: a bucketed step's view is its whole index region
        assert (indices[n:m] == spec.scratch_page).all() and indptr[step.padded_batch_size] == m
        assert indices.shape[0] == (pool.layout.index_capacity if bucket else m), f"seed {seed}"
        assert np.array_equal(dg.listed().numpy(), indices[:m]), f"seed {seed}"  # (the step's entries alone)
        assert (lens[B:] == step.q_len).all() and np.array_equal(np.diff(indptr)[B:], [-(-step.q_len // 4)] * pad)
    assert step.padded_num_tokens == (step.padded_batch_size * step.q_len if bucket else T)
    assert (got["slots"][T:] // 4 == spec.scratch_page).all(), f"seed {seed}"


def test_a_one_request_decode_copies_its_own_arrays_only():
    """The byte counter (what the commit's copies and device work read of the staging): a decode step's head (the
    bucket's rows, first pages, lengths, update region and fence) and 4 bytes per page its list holds (the window
    group's list is derived from it on the device); a verify step's arrays staged on the host: qo_indptr [2], per
    group indptr [2], last_page_len [1], kv_lens [1], int64 slots, then 4 bytes per page each group reads. Nothing
    of the rest of the pool's buffers (on CUDA; the CPU's torch ops copy a group's whole index region)."""
    spec = spec_for(page_size=16, num_pages=5000, groups=GROUPS)
    pool = pool_for(spec, max_batch_size=256, max_num_tokens=8192, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    rng = np.random.default_rng(0)
    plan = build_plan(random_batch(rng, [1], [2000], 16, 5000), spec)
    pool.commit(plan)
    assert pool.last_commit_bytes == 4 * pool.layout.at(1, 1).draft + 4 * 125
    assert pool.layout.size * 4 > 100 * pool.last_commit_bytes  # what one copy of the whole slot would move
    plan = build_plan(random_batch(rng, [4], [2000], 16, 5000), spec)  # (a verify step: staged on the host)
    pool.commit(plan)
    pages = sum(gp.kv_indices.shape[0] for gp in plan.groups)  # 125 + 1 (the window group reads one page)
    head = (2 + 2 * (2 + 1 + 1)) * 4 + 8 * 4
    assert pool.last_commit_bytes == head + 4 * pages == 72 + 4 * 126


def test_views_are_cached_for_bucketed_shapes_only():
    """Thousands of distinct eager (prefill / extend) shapes leave no bookkeeping behind; the view
    cache is bounded by slots x buckets x q_lens."""
    rng = np.random.default_rng(fresh_seed())
    spec = spec_for(page_size=4, num_pages=4000, groups=GROUPS)
    pool = pool_for(spec, max_num_tokens=2048)
    for i in range(2000):
        B = int(rng.integers(2, 30))
        q = rng.integers(2, 40, B)
        q[0] = 1 + (i % 2) * 40  # a decode row beside chunks (mixed), or a long chunk: never bucketed
        kv = q + rng.integers(0, 20, B) * rng.integers(0, 2, B)
        step = pool.commit(build_plan(random_batch(rng, q, kv, 4, 4000), spec))
        assert step.bucket is None
    assert not pool._views
    for B in range(1, 17):
        for q_len in (1, 4, MAX_VERIFY_Q_LEN):
            plan = build_plan(random_batch(rng, [q_len] * B, rng.integers(q_len + 1, 30, B), 4, 4000), spec)
            pool.commit(plan), pool.commit(plan)  # once per slot
    assert len(pool._views) == 2 * pool.num_slots * len(pool.buckets) * 3  # (views, and the kept StepShape)


def test_stale_steps_are_refused_and_live_ones_run():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=300, groups=GROUPS)
    pool = pool_for(spec)
    cache = PagedKVCache.allocate(spec)
    plans = [build_plan(random_batch(rng, [1, 1], [5, 9], 4, 300), spec) for _ in range(3)]
    steps = [pool.commit(p) for p in plans]  # two slots: the third commit reuses the first's slot
    q = torch.randn(2, 4, 16)
    assert not steps[0].live and steps[1].live and steps[2].live
    with pytest.raises(StaleStepError, match=r"stale: pool slot 0 has been committed again"):
        kernels.run(steps[0], q, cache)
    with pytest.raises(StaleStepError):
        kernels.write_kv(steps[0], torch.randn(2, 2, 16), torch.randn(2, 2, 16), cache)
    for step in steps[1:]:
        kernels.write_kv(step, torch.randn(2, 2, 16), torch.randn(2, 2, 16), cache)
        assert torch.equal(kernels.run(step, q, cache), kernels.run(step.plan, q, cache))


def test_a_failed_check_changes_nothing():
    """Every check runs before any state changes: a plan too large for the pool, or for another
    spec, raises PlanError and the pool's slots, generations, counters and live steps stay."""
    rng = np.random.default_rng(fresh_seed())
    spec = spec_for(page_size=4, num_pages=1200, groups=GROUPS)
    pool = pool_for(spec, max_batch_size=8, max_num_tokens=40, max_num_pages=60, buckets=(1, 2, 4, 8))
    live = pool.commit(build_plan(random_batch(rng, [1, 1], [5, 9], 4, 300), spec))
    before = (pool.next_slot, list(pool.generations), pool.bytes_to_device, [d.clone() for d in pool.dev])
    too_big = [
        build_plan(random_batch(rng, [1] * 9, [3] * 9, 4, 300), spec),  # batch
        build_plan(random_batch(rng, [300], [300], 4, 300), spec),  # tokens (past the verify padding room too)
        build_plan(random_batch(rng, [1, 1], [800, 300], 4, 1200), spec),  # pages (275 > 60 + 8 x 5 of padding room)
        build_plan(random_batch(rng, [1], [5], 4, 300), spec_for(page_size=4, num_pages=1200)),  # another spec
    ]
    for plan in too_big:
        with pytest.raises(PlanError, match="commit"):
            pool.commit(plan)
    assert (pool.next_slot, pool.generations, pool.bytes_to_device) == before[:3]
    assert all(torch.equal(a, b) for a, b in zip(pool.dev, before[3])) and live.live
    for slot in (5, 1.0, True, -1):
        with pytest.raises(PlanError, match="slot"):
            pool.commit(live.plan, slot=slot)
    with pytest.raises(PlanError, match="needs a CUDA pool"):
        pool.commit(live.plan, stream=object())
    assert (pool.next_slot, pool.generations) == before[:2] and live.live


def test_a_backend_state_failure_leaves_the_pool_usable(monkeypatch):
    """A backend whose host scheduling raises mid-commit (after the copy): the commit raises, its
    slot's previous step is stale (its buffers were overwritten), and the next commit works."""
    from mstar_attn.kernels import flash_attn as fa

    monkeypatch.setattr(fa, "_varlen_func", lambda: None)
    rng = np.random.default_rng(fresh_seed())
    spec = spec_for(page_size=4, num_pages=300, groups=GROUPS, dtype=torch.bfloat16, head_dim=64, backend="flash_attn")
    pool = pool_for(spec)
    first = pool.commit(build_plan(random_batch(rng, [1, 1], [5, 9], 4, 300), spec))
    sched = pool.backend_state("flash_attn")

    def broken(step):
        raise RuntimeError("backend state broke")

    monkeypatch.setattr(sched, "schedule", broken)
    with pytest.raises(RuntimeError, match="backend state broke"):
        pool.commit(build_plan(random_batch(rng, [1], [7], 4, 300), spec))
    monkeypatch.undo()
    monkeypatch.setattr(fa, "_varlen_func", lambda: None)
    assert first.live  # the failed commit went to the other slot
    again = pool.commit(build_plan(random_batch(rng, [1, 1, 1], [5, 9, 13], 4, 300), spec))
    assert again.live and again.scheduled[0].shape[0] == again.padded_batch_size


def test_scratch_plans_commit_and_capture_shapes():
    spec = spec_for(page_size=4, num_pages=50, groups=GROUPS)
    pool = pool_for(spec)
    for b in pool.buckets:
        for q_len in (1, 4, 16):
            step = pool.commit(scratch_plan(spec, b, q_len))
            assert step.bucket == b and step.padded_num_tokens == b * q_len
            assert (step.slot_mapping.numpy() // 4 == spec.scratch_page).all()


def test_pool_arguments_are_checked():
    spec = spec_for(page_size=4, num_pages=50)
    for kw, match in [(dict(max_batch_size=0), "max_batch_size"), (dict(max_num_tokens=-1), "max_num_tokens"),
                      (dict(buckets=(1, 2.5)), "buckets"), (dict(num_slots=0), "num_slots"),
                      (dict(float_workspace_bytes=0), "float_workspace_bytes")]:
        with pytest.raises(PlanError, match=match):
            pool_for(spec, **kw)
    for kw, match in [(dict(buckets=("1",)), "buckets"), (dict(buckets=None), "buckets"),
                      (dict(max_pages_per_request=0), "max_pages_per_request")]:
        with pytest.raises(PlanError, match=match):
            pool_for(spec, **kw)
    with pytest.raises(PlanError, match="device: 'bogus'"):
        GraphBufferPool(spec, PoolLimits(max_batch_size=8, max_num_tokens=8, max_num_pages=8), device="bogus")
    with pytest.raises(PlanError, match="scheduler_option_typo"):  # a typo is named (capture/limits.py)
        pool_for(spec, scheduler_option_typo=1)


def test_memory_report_counts_what_the_pool_holds():
    spec = spec_for(page_size=4, num_pages=50, groups=GROUPS)
    pool = pool_for(spec)
    report = pool.memory_report()
    assert report.components["pool slot buffers"] == (pool.layout.size * 4 * 2, 0)
    assert report.device == sum(t.numel() * 4 for t in pool.dev) and report.pinned == 0  # a CPU pool pins nothing
    assert "total" in str(report)


def test_hand_edited_plans_are_not_trusted():
    """commit and the reference refuse a plan build_plan did not make: attrs.evolve makes a new plan
    (a backend that cannot serve it, page ids outside the cache, no groups) that nothing checked."""
    import attrs

    spec = spec_for(page_size=4, num_pages=300, groups=GROUPS)
    plan = build_plan(random_batch(np.random.default_rng(fresh_seed()), [3, 2], [9, 5], 4, 300), spec)
    pool, cache = pool_for(spec), PagedKVCache.allocate(spec)
    g = plan.groups[0]
    for bad in (attrs.evolve(plan, backend="flash_attn_varlen"), attrs.evolve(plan, groups=()),
                attrs.evolve(plan, groups=(attrs.evolve(g, kv_indices=np.array([10**6] * g.kv_indices.shape[0], np.int32)), g))):
        assert not bad.sealed
        with pytest.raises(PlanError, match="not made by build_plan"):
            pool.commit(bad)
        with pytest.raises(PlanError, match="not made by build_plan"):
            reference.run(bad, torch.randn(5, 4, 16), cache)
    assert plan.sealed and pool.commit(plan).live


def test_a_cache_on_another_device_than_the_pool_is_refused():
    spec = spec_for(page_size=4, num_pages=64, groups=GROUPS)
    step = pool_for(spec).commit(build_plan(random_batch(np.random.default_rng(0), [1], [5], 4, 64), spec))
    meta = PagedKVCache(torch.empty(spec.cache_shape, device="meta"), torch.empty(spec.cache_shape, device="meta"))
    with pytest.raises(PlanError, match="the cache is on meta, the step's pool on cpu"):
        kernels.run(step, torch.randn(1, 4, 16, device="meta"), meta)


def test_replay_refuses_another_pools_step_and_inputs_unlike_the_captured_ones():
    """DecodeGraphs checks what a replay cannot: the step belongs to its pool, and each input has the
    captured buffer's dtype, trailing shape and device (a replay copies into it, which would cast or
    broadcast silently). A stand-in graph plays the captured one on the CPU."""
    from mstar_attn.capture.graphs import DecodeGraphs

    spec = spec_for(page_size=4, num_pages=64, groups=GROUPS)
    pool, other = pool_for(spec), pool_for(spec)
    graphs = DecodeGraphs(pool, lambda step, x: x["q"], {"q": torch.zeros(16, 4, 16)})
    plan = build_plan(random_batch(np.random.default_rng(0), [1] * 3, [5, 6, 7], 4, 64), spec)
    replays = []

    class Graph:
        def replay(self):
            replays.append(1)

    step = pool.commit(plan)
    with pytest.raises(PlanError, match="graph_for: no captured graph serves this step"):
        graphs.graph_for(step)
    graphs.graphs[(step.slot, step.bucket, 1, "reference", False, False)] = (graph := Graph(), torch.zeros(16, 4, 16))
    assert graphs.serves(step) and graphs.graph_for(step) is graph
    for bad, match in [(torch.randn(3, 4, 16, dtype=torch.float64), "float32"), (torch.randn(3, 1, 16), r"\[rows, 4, 16\]"),
                       (torch.randn(3, 4, 16, device="meta"), "on cpu"), (torch.randn(5, 4, 16), "has 5 rows")]:
        with pytest.raises(PlanError, match=match):
            graphs(step, q=bad)
    with pytest.raises(PlanError, match="another pool"):
        graphs(other.commit(plan), q=torch.randn(3, 4, 16))
    assert not replays
    graphs(step, q=torch.randn(3, 4, 16))
    assert replays == [1]


@pytest.mark.parametrize("q, kv", [([1] * 3, [3, 17, 30]), ([4] * 3, [5, 22, 40]), ([3, 9], [3, 30])],
                         ids=["decode", "verify", "prefill"])
def test_an_own_pages_group_gets_its_own_slots_on_the_device(q, kv):
    """A window group on its own page list writes through its own slot_mapping region: the plan's
    slots for it, then the scratch page for padding rows; the other groups share the step's."""
    from mstar_attn import GroupPages, StepBatch

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=400, groups=(LayerGroup(), LayerGroup("window", window=6, own_pages=True)))
    need = [-(-k // 4) for k in kv]
    base, own = (np.split(rng.permutation(400)[: sum(need)], np.cumsum(need)[:-1]) for _ in range(2))
    batch = StepBatch.from_pages(q, kv, base, 4, group_pages={1: GroupPages.from_pages([0] * len(kv), own)})
    plan = build_plan(batch, spec)
    step = pool_for(spec).commit(plan)
    T = plan.num_tokens
    assert step.groups[0].slot_mapping.data_ptr() == step.slot_mapping.data_ptr()
    for g, dg in enumerate(step.groups):
        got = dg.slot_mapping.numpy()
        assert got.shape == (step.padded_num_tokens,) and np.array_equal(got[:T], plan.slots_of(g)), f"seed {seed}"
        assert (got[T:] // 4 == spec.scratch_page).all(), f"seed {seed}"
    assert not np.array_equal(plan.slots_of(0), plan.slots_of(1))


def test_cascade_capture_plans_fit_a_pool_of_few_pages():
    """Graph capture commits a cascade scratch step (one more shared page per request) per bucket and
    q_len: the layout has room for it even when max_num_pages is smaller than a bucket."""
    from mstar_attn.metadata.plan import scratch_plan

    spec = spec_for(page_size=16, num_pages=32, cascade="always")
    pool = GraphBufferPool(spec, PoolLimits(max_batch_size=64, max_num_tokens=64, max_num_pages=4,
                                            buckets=(2, 8, 64)), device="cpu")
    for bucket in pool.buckets:
        for q_len in (1, 16):
            step = pool.commit(scratch_plan(spec, bucket, q_len, cascade=True))
            assert step.plan.cascade.member_queries == bucket * q_len and step.padded_batch_size == bucket


def _keyed_apart(graphs, step, q, eager: list, wrong: tuple[bool, bool], right: tuple[bool, bool]) -> None:
    """DecodeGraphs keys its graphs by the step's kind ((cascade, token tree): the key's last two fields): a stand-in
    graph under the `wrong` kind never serves `step`, which runs eagerly (eager: the steps fn saw); one under the
    `right` kind serves it."""
    class Graph:
        def replay(self):
            raise AssertionError(f"a graph of kind {wrong} replayed a step of kind {right}")

    base = (step.slot, step.bucket, step.q_len, "reference")
    out = torch.zeros(graphs.inputs["q"].shape)
    graphs.graphs[base + wrong] = (Graph(), out)
    assert not graphs.serves(step)
    graphs(step, q=q)
    assert eager == [step]
    graphs.graphs[base + right] = (Graph(), out)
    assert graphs.serves(step)


def test_a_flat_graph_never_replays_a_cascade_step():
    """Graphs are keyed by whether the step is a cascade (plan.cascade): a graph captured for a flat
    step of the same slot, bucket, q_len and backend does not serve a cascade step (its kernels read
    other arrays); the cascade step runs eagerly until a cascade graph is captured. Stand-in graphs."""
    from mstar_attn import StepBatch
    from mstar_attn.capture.graphs import DecodeGraphs

    spec = spec_for(page_size=4, num_pages=64, cascade="always")
    pool = pool_for(spec)
    eager = []
    graphs = DecodeGraphs(pool, lambda step, x: eager.append(step) or x["q"], {"q": torch.zeros(16, 4, 16)})
    batch = StepBatch.from_pages(np.ones(3, np.int32), np.array([9, 10, 11], np.int32), [[1, 2, 3], [1, 2, 4], [1, 2, 5]], 4)
    step = pool.commit(build_plan(batch, spec))
    assert step.plan.cascade is not None and step.bucket is not None

    _keyed_apart(graphs, step, torch.randn(3, 4, 16), eager, wrong=(False, False), right=(True, False))



def test_a_chain_graph_never_replays_a_tree_step():
    """Graphs are keyed by whether the step verifies token trees (plan.tree): a graph captured for a chain
    verify of the same slot, bucket, q_len and backend does not serve a tree step (its kernels attend with
    the causal mask); the tree step runs eagerly until a tree graph is captured. Stand-in graphs."""
    from mstar_attn import DraftTree, StepBatch, build_tree_plan
    from mstar_attn.capture.graphs import DecodeGraphs

    spec = spec_for(page_size=4, num_pages=64)
    pool = pool_for(spec)
    eager = []
    graphs = DecodeGraphs(pool, lambda step, x: eager.append(step) or x["q"], {"q": torch.zeros(64, 4, 16)})
    batch = StepBatch.from_pages([3, 3], [9, 10], [[1, 2, 3], [4, 5, 6]], 4)
    step = pool.commit(build_tree_plan(batch, spec, DraftTree.from_parents([[-1, 0, 0], [-1, 0, 1]])))
    assert step.plan.tree is not None and step.bucket is not None and step.q_len == 3

    _keyed_apart(graphs, step, torch.randn(6, 4, 16), eager, wrong=(False, False), right=(False, True))
    chain = scratch_plan(spec, 2, 3, tree=True)
    assert chain.tree.parents.tolist() == [-1, 0, 1] * 2 and chain.positions.tolist() == [1, 2, 3] * 2
    with pytest.raises(PlanError, match="a tree step is a verify step of 2\\+ tokens"):
        scratch_plan(spec, 2, 1, tree=True)

def test_scheduler_for_still_works_with_a_deprecation_naming_backend_state():
    spec = AttentionSpec(4, 2, 16, 4, 64, backend="reference")
    pool = pool_for(spec)
    with pytest.warns(DeprecationWarning, match=r"pool\.backend_state\(backend\)"):
        assert pool.scheduler_for("reference") is pool.backend_state("reference")


def test_the_padded_sizes_keep_their_old_names_with_a_deprecation():
    """DeviceStep.rows / num_rows and StepShape.rows / num_rows (before padded_batch_size / padded_num_tokens)
    still read, with a DeprecationWarning naming the new field."""
    seed = fresh_seed()
    spec = spec_for(page_size=4, num_pages=200, groups=GROUPS)
    step = pool_for(spec).commit(build_plan(random_batch(np.random.default_rng(seed), [1] * 3, [5, 9, 2], 4, 200), spec))
    for obj, name in ((step, "DeviceStep"), (step.shape, "StepShape")):
        with pytest.warns(DeprecationWarning, match=f"{name}.rows is deprecated: use padded_batch_size"):
            assert obj.rows == obj.padded_batch_size == step.bucket, seed
        with pytest.warns(DeprecationWarning, match=f"{name}.num_rows is deprecated: use padded_num_tokens"):
            assert obj.num_rows == obj.padded_num_tokens == step.bucket, seed
