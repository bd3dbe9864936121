"""metadata/native.py and step_checks.c, the compiled step builder: built here with the machine's C compiler, and held
to its Python twin (listed.twin_exact_lists) on random decode steps listing exactly their pages, valid and broken in
every way the checks cover, on pools small enough for its bit table and past it (where it leaves the twin to decide)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mstar_attn import StepBatch, build_plan
from mstar_attn.metadata import native
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.listed import twin_exact_lists
from tests.helpers import fresh_seed, spec_for

KINDS = ("valid", "valid", "spare_after_end", "q2", "q0", "kv0", "kv_negative", "outside_negative", "outside_high",
         "outside_int32", "short", "long", "shared_written", "written_twice", "written_in_own_list", "indptr_start", "indptr_first",
         "past_end")
HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None and os.environ.get(native.ENV_SWITCH, "1") != "0"


def broken_step(rng, B: int, ps: int, num_pages: int, kind: str) -> StepBatch:
    """A decode step of B requests on pages of ps tokens that lists exactly its pages (distinct random ids below
    num_pages), then broken (or not) by `kind`; made with from_csr, so its arrays are packed."""
    kv = rng.integers(1, 5 * ps + 2, B).astype(np.int64)
    q = np.ones(B, np.int64)
    need = -(-kv // ps)
    count = int(need.sum())
    stride = num_pages // count  # (distinct ids: one in each stride of the pool, in random order)
    pages = rng.permutation(count).astype(np.int64) * stride + rng.integers(0, stride, count)
    indptr = np.concatenate([[0], np.cumsum(need)])
    i, j = int(rng.integers(B)), int(rng.integers(B))
    last = lambda r: int(indptr[r + 1]) - 1  # noqa: E731  (request r's written page, in pages)
    extra = np.zeros(0, np.int64)
    if kind == "spare_after_end":  # ids past page_indptr[B]: never read, so never checked (valid)
        extra = np.array([-1, num_pages, int(pages[last(i)])])
    elif kind == "q2":
        q[i] = 2
    elif kind == "q0":
        q[i] = 0
    elif kind in ("kv0", "kv_negative"):
        kv[i] = 0 if kind == "kv0" else -ps
    elif kind.startswith("outside"):
        pages[int(rng.integers(pages.shape[0]))] = {"outside_negative": -1, "outside_high": num_pages,
                                                    "outside_int32": 2**31 - 1}[kind]
    elif kind == "short":  # a length one page past its list: the indptr no longer matches
        kv[i] += ps
    elif kind == "long":  # one page listed past what the length needs
        pages = np.insert(pages, int(indptr[i + 1]), num_pages - 1)
        indptr[i + 1 :] += 1
    elif kind == "shared_written" and B > 1 and i != j:  # another request lists i's written page
        at = int(rng.integers(indptr[j], indptr[j + 1]))
        pages[at] = pages[last(i)]
    elif kind == "written_twice" and B > 1 and i != j:  # two requests write one page
        pages[last(j)] = pages[last(i)]
    elif kind == "written_in_own_list" and need[i] > 1:  # its writer lists it twice
        pages[int(indptr[i])] = pages[last(i)]
    elif kind == "indptr_start":
        indptr = indptr + 1
    elif kind == "indptr_first":  # the rest of the running sum as it should be
        indptr[0] = int(rng.integers(1, 3))
    elif kind == "past_end":  # page_indices stops short of page_indptr[B]
        pages = pages[:-1]
    fit = lambda a: np.clip(a, -(2**31), 2**31 - 1).astype(np.int32)  # noqa: E731
    return StepBatch.from_csr(fit(q), fit(kv), fit(indptr), fit(np.concatenate([pages, extra])), ps)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0): the Python twin serves")
def test_the_compiled_builder_builds_and_loads_here():
    assert native.load() and native.in_use()
    assert native.library_path().exists()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_the_compiled_builder_is_its_python_twin():
    """step_checks.c's exact_lists against twin_exact_lists on 1,500 random steps (1..300 requests, page sizes 1..64,
    pools of 14 to 16M pages), each valid or broken one of 15 ways, with and without the ownership check: the same
    longest length, or both 0; the compiled builder leaves the ownership check of pools past its table (8M pages) to
    the twin, and only that. Both outcomes occur for every kind of break that can pass unchecked, and the kinds that
    must fail fail. The int32 bounds: test_the_int32_bounds_are_the_twins."""
    outcomes = {kind: set() for kind in KINDS}
    undecided = 0
    for _ in range(1500):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps = int(rng.choice([1, 3, 16, 64]))
        B = int(rng.choice([1, 2, 7, 40, 41, 64, 65, 300]))
        large = rng.random() < 0.1  # (pools of 100k and 1M pages; 8M, the compiled table's most; past it)
        num_pages = int(rng.choice([100_000, 1 << 20, 1 << 23, (1 << 23) + 8, 16 << 20])) if large else \
            int(rng.integers(B * 6 + 8, B * 6 + 4000))
        kind = KINDS[int(rng.integers(len(KINDS)))]
        step = broken_step(rng, B, ps, num_pages, kind)
        spec = spec_for(page_size=ps, num_pages=num_pages)
        packed = step.packed
        assert packed is not None and packed.shape[0] == 3 * B + 1 + step.page_indices.shape[0]
        for own in (True, False):
            compiled = native.exact_lists(packed, B, step.page_indices.shape[0], ps, num_pages, own)
            twin = twin_exact_lists(step, spec, own)
            where = f"seed {seed}, kind {kind}, B {B}, page size {ps}, pool {num_pages}, ownership {own}"
            past_table = own and num_pages > 1 << 23  # (an ownership table past 1 MB: the twin's to decide)
            assert compiled is not None or past_table, where
            assert compiled is None or not (past_table and twin), where  # (no step passes without its ownership check)
            if compiled is None:
                undecided += 1
                continue
            assert compiled == twin, f"{where}: compiled {compiled}, twin {twin}"
            outcomes[kind].add((own, compiled > 0))
    must_fail = ("q2", "q0", "kv0", "kv_negative", "outside_negative", "outside_high", "outside_int32", "short",
                 "long", "indptr_start", "indptr_first", "past_end")
    for kind in must_fail:
        assert outcomes[kind] <= {(True, False), (False, False)} and outcomes[kind], (kind, outcomes[kind])
    for kind in ("shared_written", "written_twice", "written_in_own_list"):  # fail the ownership check only
        assert (True, False) in outcomes[kind] and (False, True) in outcomes[kind], (kind, outcomes[kind])
    assert (True, True) in outcomes["valid"] and (True, True) in outcomes["spare_after_end"], outcomes
    assert undecided > 0


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_the_int32_bounds_are_the_twins():
    """Exact-list steps at each int32 bound, just inside and just past it: the longest length within INT32_MAX -
    page_size (one request, pages of 2^20 and 2^16 + 3 tokens), and every page count sum within int32 (65,535
    requests, pages of 1 and 16 tokens: B * (longest / page_size + 1)). The compiled builder and the twin agree, and
    pass exactly the steps inside."""
    INT32_MAX = 2**31 - 1
    cases = []
    for ps in (1 << 20, (1 << 16) + 3):  # the longest length's bound
        for over in (-1, 0, 1, ps - 1):
            cases.append((ps, np.array([INT32_MAX - ps + over], np.int64), over <= 0))
    B = 65535
    for ps in (1, 16):  # the page counts' sum
        fits = (INT32_MAX // B - 1) * ps + ps - 1  # (the longest length whose B * (k / ps + 1) fits int32)
        for k, ok in ((fits, True), (fits + 1, False)):
            kv = np.ones(B, np.int64)
            kv[int(np.random.default_rng(k).integers(B))] = k
            cases.append((ps, kv, ok))
    for ps, kv, ok in cases:
        need = -(-kv // ps)
        indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
        pages = np.arange(int(need.sum()), dtype=np.int32)
        step = StepBatch.from_csr(np.ones(kv.shape[0], np.int32), kv.astype(np.int32), indptr, pages, ps)
        spec = spec_for(page_size=ps, num_pages=pages.shape[0] + 16)
        for own in (True, False):
            compiled = native.exact_lists(step.packed, kv.shape[0], pages.shape[0], ps, spec.num_pages, own)
            twin = twin_exact_lists(step, spec, own)
            where = f"page size {ps}, B {kv.shape[0]}, longest {kv.max()}, ownership {own}"
            assert compiled == twin == (int(kv.max()) if ok else 0), f"{where}: compiled {compiled}, twin {twin}"


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_build_plan_is_the_same_with_and_without_the_compiled_builder():
    """build_plan of random steps, valid and broken, with the compiled builder and with the twin (native.disabled()):
    equal plans, or the same PlanError."""
    for _ in range(300):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps, B = int(rng.choice([1, 16])), int(rng.choice([1, 8, 65]))
        kind = KINDS[int(rng.integers(len(KINDS)))]
        spec = spec_for(page_size=ps, num_pages=B * 6 + 64)
        step = broken_step(rng, B, ps, spec.num_pages, kind)
        results = []
        for off in (False, True):
            with native.disabled() if off else _nothing():
                assert native.in_use() != off
                try:
                    results.append(build_plan(step, spec))
                except PlanError as e:
                    results.append(str(e))
        assert results[0] == results[1], f"seed {seed}, kind {kind}: {results}"


def test_disabled_leaves_the_twin_to_decide():
    step = StepBatch.from_csr(np.ones(1, np.int32), np.array([20], np.int32), np.array([0, 2], np.int32),
                              np.array([5, 7], np.int32), 16)
    with native.disabled():
        with native.disabled():
            assert native.exact_lists(step.packed, 1, 2, 16, 8, True) is None
        assert not native.in_use()
    assert native.exact_lists(step.packed, 1, 2, 16, 8, True) == (20 if native.in_use() else None)


def test_no_compiler_or_the_switch_leaves_the_twin_serving(tmp_path):
    """A process whose compiler fails (CC=false), whose cache directory others may write, or whose CC names no program
    warns once and plans with the twin; one with MSTAR_ATTN_NATIVE=0 builds nothing. Each plans the same step, in a
    fresh process with a cache directory of its own, and leaves no library (nor a partial build) there."""
    code = ("import warnings, numpy as np; warnings.simplefilter('always')\n"
            "from mstar_attn import StepBatch, build_plan; from mstar_attn.metadata import native\n"
            "from tests.helpers import spec_for\n"
            "s = StepBatch.from_csr(np.ones(1, np.int32), np.array([20], np.int32), np.array([0, 2], np.int32), "
            "np.array([5, 7], np.int32), 16)\n"
            "print(native.load(), build_plan(s, spec_for(page_size=16, num_pages=8)).max_kv_len)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # (a directory others may write: a library found there is not loaded, none is built there)
    for extra, warning in (({"CC": "false"}, "building step_checks.c failed"), ({native.ENV_SWITCH: "0"}, None),
                           ({native.ENV_CACHE: str(shared)}, "no cache directory of this user's own"),
                           ({"CC": "no-such-compiler --flag"}, "is not a program on PATH")):
        cache = str(tmp_path / next(iter(extra)).lower())
        env = {**os.environ, native.ENV_CACHE: cache, "PYTHONPATH": root, **extra}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["False", "20"], (extra, done.stdout, done.stderr)
        assert (warning is None and "RuntimeWarning" not in done.stderr) or (warning and warning in done.stderr), (
            extra, done.stderr)
        assert not any(Path(env[native.ENV_CACHE]).glob("*.so*")), extra  # (no build left, nor a partial one)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_rows_decode_is_its_twin():
    """step_checks.c's rows_decode against _plan_rows_decode's reductions (through build_plan with the compiled builder
    and with native.disabled(): equal plans or the same PlanError) and against the rule itself, on 800 random
    StepRows.decode steps of 41 to 600 requests (past SHORT_CHECK, where the planner calls it), valid or broken."""
    from mstar_attn import StepRows

    kinds = ("valid", "valid", "kv0", "kv_negative", "row_negative", "past_int32", "sum_past_int32", "int32_min")
    seen = set()
    for _ in range(800):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        ps, B = int(rng.choice([1, 16, 64])), int(rng.choice([41, 64, 65, 600]))
        kind = kinds[int(rng.integers(len(kinds)))]
        rows = rng.permutation(4 * B)[:B].astype(np.int64)
        kv = rng.integers(1, 5000, B).astype(np.int64)
        i = int(rng.integers(B))
        if kind in ("kv0", "kv_negative"):
            kv[i] = 0 if kind == "kv0" else -1
        elif kind == "row_negative":
            rows[i] = -int(rng.integers(1, 3))
        elif kind == "past_int32":
            kv[i] = 2**31 - 1 - int(rng.integers(ps))
        elif kind == "sum_past_int32":
            kv[:] = (2**31 - 1) // B
        elif kind == "int32_min":
            kv[i] = -(2**31)
        step = StepRows.decode(rows.astype(np.int32), kv.astype(np.int32))
        hi = int(kv.max())
        rule = hi if kv.min() >= 1 and rows.min() >= 0 and hi <= 2**31 - 1 - ps and B * (hi // ps + 1) <= 2**31 - 1 else 0
        compiled = native.rows_decode(step.packed, B, ps)
        where = f"seed {seed}, kind {kind}, B {B}, page size {ps}"
        assert compiled == rule, f"{where}: compiled {compiled}, rule {rule}"
        spec = spec_for(page_size=ps, num_pages=64)
        results = []
        for off in (False, True):
            with native.disabled() if off else _nothing():
                try:
                    results.append(build_plan(step, spec))
                except PlanError as e:
                    results.append(str(e))
        assert results[0] == results[1], f"{where}: {results}"
        seen.add((kind, rule > 0))
    assert ("valid", True) in seen and all((k, False) in seen for k in kinds[2:]), seen



@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_the_compiled_builder_reads_only_arrays_it_may():
    """The C side reads an array's data pointer for as many int32 as the call names: anything but a C-contiguous numpy
    int32 array of exactly that size is left to the twin (None), never read."""
    good = np.array([1, 20, 0, 2, 5, 7], np.int32)
    assert native.exact_lists(good, 1, 2, 16, 8, True) == 20
    for bad in (good.astype(np.int64), np.repeat(good, 2)[::2], good[:5], np.concatenate([good, good]), good.tolist()):
        assert native.exact_lists(bad, 1, 2, 16, 8, True) is None, bad
    one = np.ones(1, np.int32)  # (sizes whose sum matches the array's but that would read elsewhere)
    assert native.exact_lists(one, 10**8, -3 * 10**8, 16, 8, False) is None
    assert native.exact_lists(one, 0, 0, 16, 8, False) is None and native.rows_decode(np.zeros(0, np.int32), 0, 16) is None
    rows = np.array([3, 20], np.int32)
    assert native.rows_decode(rows, 1, 16) == 20
    for bad in (rows.astype(np.uint32), np.repeat(rows, 2)[::2], rows[:1], rows.tolist()):
        assert native.rows_decode(bad, 1, 16) is None, bad


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here (or MSTAR_ATTN_NATIVE=0)")
def test_within_is_its_twin():
    """step_checks.c's within against _arrays.within on 2,000 random ranges and values near their edges and at int32's
    (wrapping subtraction, empty spans, values as views); Ranges.holds the same with and without the compiled
    builder."""
    from mstar_attn.metadata._arrays import Ranges, within

    both = set()
    for _ in range(2000):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        B = int(rng.choice([1, 41, 64, 300]))
        low = rng.choice([-(2**31), -5, 0, 1, 100, 2**31 - 10], B).astype(np.int64) + rng.integers(0, 3, B)
        low = np.clip(low, -(2**31), 2**31 - 1).astype(np.int32)
        span = rng.choice([0, 1, 2, 7, 2**31, 2**32 - 1], B).astype(np.uint32)
        values = (low.astype(np.int64) + rng.choice([-1, 0, 1, 6, 7, 2**31], B)).astype(np.int64)
        values = ((values + 2**31) % 2**32 - 2**31).astype(np.int32)  # (int32, wrapped)
        if rng.random() < 0.5:  # (every one inside)
            span, values = np.full(B, 2**32 - 1, np.uint32), low.copy()
        values = np.concatenate([rng.integers(0, 9, 3).astype(np.int32), values])[3:]  # (a view past an array's start)
        twin = within(values, low, span)
        assert native.within(values, low, span) == twin, f"seed {seed}, B {B}"
        r = Ranges(low, span)
        with native.disabled():
            off = r.holds(values)
        assert r.holds(values) == off, f"seed {seed}, B {B}"  # (up to SHORT_CHECK values: Python ints either way)
        both.add(twin)
    assert both == {True, False}
