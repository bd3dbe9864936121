"""Host integer arrays as the planner takes them: validated, int32, read-only; attrs fields for them.

Every array a StepBatch holds goes through `int_array`: integer dtypes only (bool, float, object and
string arrays are rejected, never truncated or parsed), the rank checked, every value checked
against int32 before it is cast. int32 input is copied without a value scan.
"""

from __future__ import annotations

from itertools import accumulate

import attrs
import numpy as np

from mstar_attn.metadata import native
from mstar_attn.metadata.errors import PlanError

INT32_MAX = 2**31 - 1
INT32 = np.dtype(np.int32)  # (native byte order: the dtype object numpy gives every such array)


def is_int32(value, ndim: int) -> bool:
    """Whether `value` is a numpy array of native int32 and rank `ndim` (what int_array copies without a value scan)."""
    return type(value) is np.ndarray and value.dtype is INT32 and value.ndim == ndim


# numpy's concatenate without its __array_function__ dispatch (exact ndarrays only, as packed_int32 passes it)
_CONCATENATE = getattr(np.concatenate, "__wrapped__", np.concatenate)


def packed_int32(arrays: tuple) -> np.ndarray | None:
    """One read-only int32 copy of `arrays` back to back (their views are what int_array makes of each: the per-step
    path's one copy), when each is a numpy array of native int32 and rank 1 (is_int32); else None."""
    for a in arrays:
        if not is_int32(a, 1):
            return None
    packed = _CONCATENATE(arrays)
    packed.setflags(write=False)
    return packed


def int_array(name: str, value, ndim: int, request: int | None = None) -> np.ndarray:
    """A read-only int32 copy of `value` (a list or numpy array of integers of rank `ndim`), or PlanError.
    request: the request the whole array belongs to (one request's page list), named in errors;
    None: a 1-D array is indexed by request."""
    if is_int32(value, ndim):  # (the common case, per step)
        out = value.copy()
        out.setflags(write=False)
        return out
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested lists, objects numpy cannot hold
        raise PlanError(f"{name}: expected a {ndim}-D array of integers ({' '.join(str(e).split())[:120]})") from None
    if a.dtype.kind not in "iu":
        if not (a.size == 0 and a.dtype.kind == "f"):  # [] becomes float64: an empty integer list
            raise PlanError(f"{name}: integers required, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise PlanError(f"{name}: expected a {ndim}-D array, got shape {a.shape}")
    if a.size and a.dtype != np.int32 and a.dtype.itemsize >= 4:  # int64, uint32, uint64 may not fit
        if a.min() < -INT32_MAX - 1 or a.max() > INT32_MAX:
            bad = np.flatnonzero(((a < -INT32_MAX - 1) | (a > INT32_MAX)).reshape(-1))[0]
            where = np.unravel_index(bad, a.shape)
            owner = request if request is not None else where[0] if ndim == 1 else None
            raise PlanError(f"{name}[{', '.join(map(str, where))}] = {a[where]} is outside int32"
                            + (f" (request {owner})" if owner is not None else ""))
    out = np.array(a, dtype=np.int32)
    out.flags.writeable = False
    return out


def positive_int(name: str, value) -> int:
    """value as a Python int if it is an integer >= 1 (bool excluded), else PlanError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name}: expected a positive integer, got {value!r}")
    if value < 1 or value > INT32_MAX:
        raise PlanError(f"{name}: expected an integer in 1..{INT32_MAX}, got {value}")
    return int(value)


def _same_or_none(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def array_field(**kw):
    """An attrs field holding a numpy array: compared by value, shown by shape."""
    return attrs.field(eq=attrs.cmp_using(eq=np.array_equal), repr=lambda a: f"array{a.shape}", **kw)


def nullable_array_field(**kw):
    """A required attrs field holding a numpy array or None (page ids a StepRows plan leaves to the device)."""
    return attrs.field(eq=attrs.cmp_using(eq=_same_or_none), repr=lambda a: "None" if a is None else f"array{a.shape}", **kw)


def optional_array_field(**kw):
    """An attrs field holding a numpy array or None (default None)."""
    return attrs.field(default=None, eq=attrs.cmp_using(eq=_same_or_none), repr=False, **kw)


SHORT = 64  # per-request work over at most this many requests runs on Python lists (numpy's fixed cost per call is higher)
# a per-request range check (min / max of the lengths, Ranges.holds) over at most this many requests runs on Python ints:
# where a Python loop starts to cost more than numpy's fixed cost (CPU host, Python 3.11: about 32 for a range check
# per request, 48 for three min / max)
SHORT_CHECK = 40


class Ranges:
    """Per-request half-open ranges low[i] <= value < low[i] + span[i] of int32 values ([B] int32 low, [B] uint32
    span: 0 for none), made once and checked per step by `holds` or `holds_from_one` (a page-table row's decode
    lengths, a kept FlashInfer plan's chunk counts). Host only; its bounds never change after construction (the
    arrays it is given are not written afterwards by their makers: all_hold_up_to keeps its answer)."""

    __slots__ = ("low", "span", "_diff", "_ok", "_lists", "_top")

    def __init__(self, low: np.ndarray, span: np.ndarray):
        # (C-contiguous int32 / uint32 [B], as native.within reads them)
        self.low, self.span = np.ascontiguousarray(low, np.int32), np.ascontiguousarray(span, np.uint32)
        self._top: int | None = None  # (all_hold_up_to's answer, made at its first call)
        if low.shape[0] <= SHORT_CHECK:  # the bounds as Python ints: low and low + span
            lows = self.low.tolist()
            self._lists = (lows, [lo + n for lo, n in zip(lows, self.span.tolist())])
        else:  # the numpy check's scratch
            self._lists, self._diff, self._ok = None, np.empty(low.shape[0], np.int32), np.empty(low.shape[0], np.bool_)

    def holds(self, values: np.ndarray) -> bool:
        """Whether every values[i] ([B] int32 host) lies in its range: one subtraction and one unsigned comparison
        each (for at most SHORT_CHECK requests, a Python loop; past it, the compiled builder's loop where it is in
        use: native.within, else numpy's). False for another number of values."""
        lists = self._lists
        if values.shape[0] != self.low.shape[0]:
            return False
        if lists is not None:
            for v, lo, hi in zip(values.tolist(), *lists):
                if not lo <= v < hi:
                    return False
            return True
        held = native.within(values, self.low, self.span)
        return within(values, self.low, self.span, self._diff, self._ok) if held is None else held

    def holds_from_one(self, values: np.ndarray, longest: int) -> bool:
        """holds(values) for values ([B] int32 host) each at least 1 and at most `longest`: at once where they are as
        many as the ranges and `longest` is within every range's 1..h (all_hold_up_to), else value by value."""
        return (longest <= self.all_hold_up_to() and values.shape[0] == self.low.shape[0]) or self.holds(values)

    def all_hold_up_to(self) -> int:
        """The largest h such that every request's range holds every value 1..h (0 where some range does not hold 1,
        or there are no requests): values all within 1..h hold without a per-request check (a steady commit's test
        of a step's longest length, before `holds`). Made at the first call, O(B); then O(1)."""
        top = self._top
        if top is None:
            lists = self._lists
            if self.low.shape[0] == 0:
                top = 0
            elif lists is not None:  # (the bounds as Python ints already: low and low + span)
                top = 0 if max(lists[0]) > 1 else max(min(lists[1]) - 1, 0)
            elif int(self.low.max()) > 1:
                top = 0
            else:  # (the lowest range end, less one; an empty range ends at its low: 0 if that is 1)
                top = max(int((self.low.astype(np.int64) + self.span).min()) - 1, 0)
            self._top = top
        return top


def within(values: np.ndarray, low: np.ndarray, span: np.ndarray, diff: np.ndarray | None = None,
           ok: np.ndarray | None = None) -> bool:
    """Whether low[i] <= values[i] < low[i] + span[i] for every i ([B] int32 values and low, [B] uint32 span): one
    subtraction and one unsigned comparison (diff [B] int32, ok [B] bool: scratch to write them into, if given)."""
    diff = np.subtract(values, low, out=diff)
    ok = np.less(diff.view(np.uint32), span, out=ok)
    return np.count_nonzero(ok) == ok.shape[0]


def short_page_spans(lengths: list[int], ps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_indptr [B+1], last_page_len [B], need [B]) int32 of B KV lengths (Python ints >= 1, at most SHORT of them,
    their pages' sum within int32) on pages of ps tokens: read-only views of one array, made from Python ints (numpy's
    fixed cost per call is higher than a short loop)."""
    need = [(k + ps - 1) // ps for k in lengths]
    B = len(lengths)
    spans = np.array([0, *accumulate(need), *(k - (n - 1) * ps for k, n in zip(lengths, need)), *need], np.int32)
    spans.flags.writeable = False  # (so are its views)
    return spans[: B + 1], spans[B + 1 : 2 * B + 1], spans[2 * B + 1 :]


def read_only(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def fail_at(field: str, bad: np.ndarray, message: str) -> None:
    """PlanError for the first request where `bad` [B] is True: names the field and the request."""
    i = int(np.flatnonzero(bad)[0])
    raise PlanError(f"{field}[{i}]: {message} (request {i})")
