"""Malformed steps: every mutation of a valid batch ends in a PlanError naming a field, or in a plan
an independent checker accepts. Never another exception, never a silently wrong plan.

A valid step is drawn (page size, requests, prefixes, spare pages, shared read-only prefix pages,
one of the three constructors), then one mutation from MUTATIONS is applied to its raw inputs:
dtypes (float, bool, object with None, strings, NaN), values outside int32, wrong ranks,
page_size of the wrong type or value, lengths out of order, page lists that overrun or decrease,
pages outside the pool or the scratch page, written pages listed twice, arrays of the wrong
length, block tables of the wrong shape, a flat list for from_pages.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mstar_attn import LayerGroup, PlanError, StepBatch, build_plan
from tests.helpers import draw_lengths, spec_for

FIELDS = ("q_lens", "kv_lens", "page_indptr", "page_indices", "pages", "block_table", "page_size", "shapes")
ARRAYS = ("q_lens", "kv_lens", "page_indptr", "page_indices")


@st.composite
def valid_steps(draw):
    """(spec, raw) with raw = dict(q, kv, pages (one list per request), page_size, ctor)."""
    ps, q, kv = draw_lengths(draw, [1, 2, 4, 16], 8, 20, 60)
    n = len(q)
    prefix = [k - a for a, k in zip(q, kv)]
    need = [-(-k // ps) for k in kv]
    spare = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    num_pages = sum(need) + sum(spare) + draw(st.integers(1, 20))
    perm = draw(st.permutations(range(num_pages)))
    pages, at = [], 0
    for i in range(n):
        pages.append(list(perm[at : at + need[i] + spare[i]]))
        at += need[i] + spare[i]
    if n > 1 and draw(st.booleans()):  # request 1 shares request 0's full, read-only prefix pages
        full = min(prefix[0], prefix[1]) // ps
        if full:
            pages[1][:full] = pages[0][:full]
    spec = spec_for(page_size=ps, num_pages=num_pages, groups=(LayerGroup(), LayerGroup("window", window=7)))
    ctor = draw(st.sampled_from(["csr", "pages", "table"]))
    return spec, dict(q=q, kv=kv, pages=pages, page_size=ps, ctor=ctor)


def csr(pages):
    indptr = np.zeros(len(pages) + 1, np.int64)
    np.cumsum([len(p) for p in pages], out=indptr[1:])
    return indptr, np.array([x for p in pages for x in p], np.int64)


def construct(raw):
    """The StepBatch the raw inputs describe (raises PlanError for malformed ones)."""
    if raw["ctor"] == "pages":
        return StepBatch.from_pages(raw["q"], raw["kv"], raw["pages"], raw["page_size"])
    if raw["ctor"] == "table":
        table = raw.get("table")
        if table is None:
            width = max(len(p) for p in raw["pages"])
            table = np.full((len(raw["pages"]), width), -1, np.int64)
            for i, p in enumerate(raw["pages"]):
                table[i, : len(p)] = p
        return StepBatch.from_block_table(raw["q"], raw["kv"], table, raw["page_size"])
    indptr, indices = raw.get("indptr"), raw.get("indices")
    if indptr is None:
        indptr, indices = csr(raw["pages"])
    return StepBatch.from_csr(raw["q"], raw["kv"], indptr, indices, raw["page_size"])


# --- mutations: fn(draw, raw) edits raw in place -------------------------------------------------

def _target(draw, raw):
    """A field to corrupt: q, kv, or (csr) indptr / indices, (table) the table, (pages) one page list."""
    names = ["q", "kv"] + {"csr": ["indptr", "indices"], "table": ["table"], "pages": ["page_list"]}[raw["ctor"]]
    name = draw(st.sampled_from(names))
    if name in ("indptr", "indices") and "indptr" not in raw:
        raw["indptr"], raw["indices"] = csr(raw["pages"])
    if name == "table" and "table" not in raw:
        construct_table(raw)
    return name


def construct_table(raw):
    width = max(len(p) for p in raw["pages"])
    table = np.full((len(raw["pages"]), width), -1, np.int64)
    for i, p in enumerate(raw["pages"]):
        table[i, : len(p)] = p
    raw["table"] = table


def _get(raw, name):
    if name == "page_list":
        return raw["pages"][0]
    return raw[name]


def _set(raw, name, value):
    if name == "page_list":
        raw["pages"][0] = value
    else:
        raw[name] = value


def m_dtype(draw, raw):
    name = _target(draw, raw)
    a = np.asarray(_get(raw, name))
    if a.size == 0:
        return
    kind = draw(st.sampled_from(["float", "float_frac", "bool", "none", "str", "nan", "pyfloat"]))
    if kind == "float":
        v = a.astype(np.float64)
    elif kind == "float_frac":
        v = a.astype(np.float64) + 0.9
    elif kind == "bool":
        v = a.astype(bool)
    elif kind == "none":
        v = a.astype(object)
        v.flat[draw(st.integers(0, a.size - 1))] = None
    elif kind == "str":
        v = a.astype(str)
    elif kind == "nan":
        v = a.astype(np.float64)
        v.flat[draw(st.integers(0, a.size - 1))] = np.nan
    else:
        v = a.tolist()
        flat = v if a.ndim == 1 else v[0]
        flat[0] = float(flat[0]) + 0.5
    _set(raw, name, v)


def m_range(draw, raw):
    name = _target(draw, raw)
    a = np.asarray(_get(raw, name))
    if a.size == 0:
        return
    value = draw(st.sampled_from([2**32 + 5, 2**31, 2**31 - 1, 2**31 - 2, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1]))
    b = a.astype(object)
    b.flat[draw(st.integers(0, a.size - 1))] = value
    values = [int(x) for x in b.flat]
    if all(-(2**63) <= x < 2**63 for x in values):
        b = b.astype(np.int64)
    elif all(0 <= x < 2**64 for x in values):
        b = b.astype(np.uint64)
    _set(raw, name, b)  # else an object array (rejected as such)


def m_rank(draw, raw):
    name = _target(draw, raw)
    a = np.asarray(_get(raw, name))
    kind = draw(st.sampled_from(["scalar", "2d", "nested", "0d"]))
    if kind == "scalar":
        v = int(a.flat[0]) if a.size else 3
    elif kind == "0d":
        v = np.array(int(a.flat[0]) if a.size else 3)
    elif kind == "2d":
        v = a.reshape(1, -1) if a.ndim == 1 else a.reshape(-1)
    else:
        v = [[int(x)] for x in a.reshape(-1)] if a.size else [[]]
    _set(raw, name, v)


def m_page_size(draw, raw):
    raw["page_size"] = draw(st.sampled_from([None, 0, -1, 2.0, True, "16", 3 if raw["page_size"] != 3 else 5, 2**31, np.float32(4)]))


def m_values(draw, raw):
    n = len(raw["q"])
    i = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["q0", "qneg", "kv_lt_q", "kv_huge", "kv_plus", "page_oob", "page_neg", "scratch",
                                 "written_twice", "drop_page"]))
    q, kv, pages = list(raw["q"]), list(raw["kv"]), [list(p) for p in raw["pages"]]
    num_pages = raw["num_pages"]
    if kind == "q0":
        q[i] = 0
    elif kind == "qneg":
        q[i] = -draw(st.integers(1, 5))
    elif kind == "kv_lt_q":
        kv[i] = q[i] - draw(st.integers(1, q[i]))
    elif kind == "kv_huge":
        kv[i] = draw(st.sampled_from([2**31 - 1, 2**31 - 16, 2**30]))
    elif kind == "kv_plus":
        kv[i] += draw(st.integers(1, 40))
    elif kind == "page_oob":
        pages[i][draw(st.integers(0, len(pages[i]) - 1))] = num_pages + 1 + draw(st.integers(0, 100))
    elif kind == "page_neg":
        pages[i][draw(st.integers(0, len(pages[i]) - 1))] = -draw(st.integers(1, 100))
    elif kind == "scratch":
        pages[i][draw(st.integers(0, len(pages[i]) - 1))] = num_pages
    elif kind == "written_twice" and n > 1:
        j = (i + 1) % n
        pages[j][draw(st.integers(0, len(pages[j]) - 1))] = pages[i][-1]
    elif kind == "drop_page" and len(pages[i]) > 1:
        pages[i].pop(draw(st.integers(0, len(pages[i]) - 1)))
    raw.update(q=q, kv=kv, pages=pages)
    raw.pop("indptr", None), raw.pop("table", None)


def m_csr(draw, raw):
    raw["ctor"] = "csr"
    indptr, indices = csr(raw["pages"])
    kind = draw(st.sampled_from(["start", "decrease", "overrun", "short_indices", "swap", "negative"]))
    i = draw(st.integers(0, len(indptr) - 1))
    if kind == "start":
        indptr = indptr + draw(st.integers(1, 3))
    elif kind == "decrease" and len(indptr) > 2:
        indptr[1] = indptr[-1] + 1
    elif kind == "overrun":
        indptr[-1] = len(indices) + draw(st.integers(1, 5))
    elif kind == "short_indices" and len(indices):
        indices = indices[: -draw(st.integers(1, len(indices)))]
    elif kind == "swap" and len(indptr) > 2:
        indptr[[0, -1]] = indptr[[-1, 0]]
    elif kind == "negative":
        indptr[i] = -draw(st.integers(1, 5))
    raw.update(indptr=indptr, indices=indices)


def m_lengths(draw, raw):
    name = draw(st.sampled_from(["q", "kv", "indptr"]))
    if name == "indptr":
        raw["ctor"] = "csr"
        raw["indptr"], raw["indices"] = csr(raw["pages"])
    a = list(np.asarray(raw[name]).tolist())
    if draw(st.booleans()) and a:
        a.pop()
    else:
        a.append(a[-1] if a else 1)
    raw[name] = a


def m_table(draw, raw):
    raw["ctor"] = "table"
    construct_table(raw)
    kind = draw(st.sampled_from(["rows", "hole", "narrow", "flat"]))
    t = raw["table"]
    if kind == "rows":
        raw["table"] = np.concatenate([t, t[:1]])
    elif kind == "hole":
        t[draw(st.integers(0, t.shape[0] - 1)), 0] = -1
    elif kind == "narrow" and t.shape[1] > 1:
        raw["table"] = t[:, :1]
    elif kind == "flat":
        raw["table"] = t.reshape(-1)


def m_pages_shape(draw, raw):
    raw["ctor"] = "pages"
    kind = draw(st.sampled_from(["flat", "scalar_entry", "string", "nested", "none"]))
    if kind == "flat":
        raw["pages"] = [x for p in raw["pages"] for x in p]
    elif kind == "scalar_entry":
        raw["pages"][0] = 5
    elif kind == "string":
        raw["pages"] = "0 1 2"
    elif kind == "nested":
        raw["pages"][0] = [raw["pages"][0]]
    else:
        raw["pages"] = None


MUTATIONS = [m_dtype, m_range, m_rank, m_page_size, m_values, m_csr, m_lengths, m_table, m_pages_shape]


def assert_plan_valid(plan, spec, raw):
    """The plan describes the (possibly mutated, still valid) step it came from: an independent check."""
    batch = construct(raw)  # the same inputs, constructed again: deterministic
    ps = spec.page_size
    q, kv, indptr, idx = batch.q_lens, batch.kv_lens, batch.page_indptr, batch.page_indices
    assert (q >= 1).all() and (kv >= q).all() and indptr[0] == 0 and (np.diff(indptr) >= -(-kv // ps)).all()
    listed = idx[: indptr[-1]]
    assert ((listed >= 0) & (listed < spec.num_pages)).all()
    t = 0
    written = {}
    for i in range(plan.batch_size):
        own = idx[indptr[i] : indptr[i + 1]]
        n = -(-int(kv[i]) // ps)
        assert np.array_equal(plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]], own[:n])
        for j in range(int(q[i])):
            pos = int(kv[i] - q[i]) + j
            assert plan.positions[t] == pos and plan.slot_mapping[t] == own[pos // ps] * ps + pos % ps
            written[int(own[pos // ps])] = i
            t += 1
    assert t == plan.num_tokens
    for page, owner in written.items():  # a written page is listed by its writer only, once
        holders = [i for i in range(plan.batch_size) for p in idx[indptr[i] : indptr[i + 1]] if p == page]
        assert holders == [owner], (page, holders)


def check(spec, raw):
    try:
        plan = build_plan(construct(raw), spec)
    except PlanError as e:
        assert any(f in str(e) for f in FIELDS), f"PlanError names no field: {e}"
        return "error"
    assert_plan_valid(plan, spec, raw)
    return "plan"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(step=valid_steps(), data=st.data())
def test_mutated_steps_end_in_plan_error_or_a_valid_plan(mutation, step, data):
    """400 mutated steps per mutation kind (3,600 in all)."""
    spec, raw = step
    raw["num_pages"] = spec.num_pages
    mutation(data.draw, raw)
    event(check(spec, raw))


@settings(max_examples=300, deadline=None)
@given(valid_steps())
def test_valid_steps_give_valid_plans(step):
    spec, raw = step
    raw["num_pages"] = spec.num_pages
    assert check(spec, raw) == "plan"


@pytest.mark.parametrize("raw, match", [
    (dict(q=[1, 4.9], kv=[3, 9], pages=[[0], [1, 2, 3]]), r"q_lens: integers required, got dtype float64"),
    (dict(q=["1", "2"], kv=[3, 9], pages=[[0], [1, 2, 3]]), r"q_lens: integers required"),
    (dict(q=[1, None], kv=[3, 9], pages=[[0], [1, 2, 3]]), r"q_lens: integers required, got dtype object"),
    (dict(q=[1, 1], kv=np.array([3, 2**32 + 5]), pages=[[0], [1]]), r"kv_lens\[1\] = 4294967301 is outside int32"),
    (dict(q=[1, 1], kv=[3, 2**31 - 3], pages=[[0], [1]]), r"kv_lens\[1\].*int32"),
    (dict(q=3, kv=[3], pages=[[0]]), r"q_lens: expected a 1-D array"),
    (dict(q=[1], kv=[3], pages=[[0]], page_size=None), r"page_size: expected a positive integer, got None"),
    (dict(q=[1, 1], kv=[3, 3], pages=[0, 1]), r"pages\[0\]: expected a list of page ids"),
])
def test_the_reported_cases(raw, match):
    """The categories first reported, each named: truncated floats, numeric strings, None inside a
    list, int64 past int32, kv_len near 2**31, a scalar q_lens, page_size None, a flat page list."""
    raw = dict(raw, page_size=raw.get("page_size", 4), ctor="pages")
    with pytest.raises(PlanError, match=match):
        build_plan(construct(raw), spec_for(page_size=4, num_pages=16))


def test_more_shapes_that_used_to_escape():
    with pytest.raises(PlanError, match="pages: expected one list"):
        StepBatch.from_pages([1], [3], np.array(5), 4)
    with pytest.raises(PlanError, match="check_ownership"):
        build_plan(StepBatch.from_pages([1], [3], [[1]], 4), spec_for(page_size=4, num_pages=16), check_ownership="no")


def test_a_2d_page_indices_is_refused():
    with pytest.raises(PlanError, match=r"page_indices: expected a 1-D array, got shape \(1, 2\)"):
        StepBatch.from_csr([1, 1], [3, 3], [0, 1, 2], [[4, 5]], 4)
