"""select_backend: which kernel backend serves a step, for specs with backend="auto".

Pure host code, run by `build_plan` once per step. The policy is a measured dispatch table
(`mstar_attn/backend_table.json`, written by `python -m mstar_attn bench --write-table`, see
`mstar_attn.tuning`): it maps a step's features to the backend that measured fastest there.
Where the table says nothing, FlashInfer paged ("flashinfer") serves the step.

Features (`table_key`): the mode class ("decode"; "prefill" = no cached prefix; "extend" =
extend, mixed and verify, i.e. new tokens over a cached prefix), the bucket of the batch size,
of the mean new tokens per request (ceil(num_tokens / batch_size)) and of the cached prefix
(max_kv_len - max_q_len; 0 for prefill), and the spec's head_dim, GQA ratio and page_size.
A bucket is an index into sorted upper bounds: with bounds (1, 4, 16) the buckets are 1 | 2-4 |
5-16 | >16 (`bucket_labels`).

The table is read once: `load_table()` is lru-cached and returns a frozen `DispatchTable`
whose lookup dict is keyed by the bucketed features, so a lookup is a few bisects and one dict
get. `select_backend` never returns a backend that cannot serve the step: compiling a table
drops entries whose backend is unknown, is not installed, cannot serve the entry's mode class or
head_dim, and each hit is checked against the step (mode, prefix_free, dtype, head_dim). The
table is measured on causal full-attention layers without logit soft-capping, so specs with
window or non-causal groups or a soft cap always get FlashInfer.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from bisect import bisect_left
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from mstar_attn.metadata.backends import AUTO, AUTO_DEFAULT, AUTO_MLA, BACKENDS
from mstar_attn.metadata.errors import PlanError
from mstar_attn.metadata.spec import Kind

DEFAULT = AUTO_DEFAULT  # where the table says nothing
TABLE_VERSION = 1
TABLE_PATH = Path(__file__).resolve().parent.parent / "backend_table.json"  # package data

# Mode value -> mode class of the table.
MODE_CLASS = {"decode": "decode", "prefill": "prefill", "extend": "extend", "mixed": "extend", "verify": "extend"}
MODE_CLASSES = ("decode", "prefill", "extend")
_CLASS_MODES = {c: frozenset(m for m, k in MODE_CLASS.items() if k == c) for c in MODE_CLASSES}
# Bucket upper bounds (inclusive), per feature: coarse, about 4x apart, so a small grid of
# measured shapes can cover them.
BOUNDS = {"batch": (1, 4, 16, 64, 256), "tokens": (1, 8, 64, 512, 4096), "prefix": (0, 1024, 4096, 16384)}
FEATURES = ("mode", "batch", "tokens", "prefix", "head_dim", "gqa", "page_size")


def bucket_labels(bounds) -> list[str]:
    """Human labels of the len(bounds) + 1 buckets: ["1", "2-4", "5-16", ">16"] for (1, 4, 16)."""
    labels, lo = [], None
    for b in bounds:
        labels.append(str(b) if lo is None or lo == b else f"{lo}-{b}")
        lo = b + 1
    return labels + [f">{bounds[-1]}"]


def step_features(mode: str, batch_size: int, num_tokens: int, max_q_len: int, max_kv_len: int) -> tuple[str, int, int, int]:
    """(mode class, batch size, mean new tokens per request (ceil), cached prefix length), unbucketed."""
    cls = MODE_CLASS[mode]
    b = max(int(batch_size), 1)
    prefix = 0 if cls == "prefill" else max(int(max_kv_len) - int(max_q_len), 0)
    return cls, b, -(-int(num_tokens) // b), prefix


def bucketed(bounds: Mapping, cls: str, batch: int, tokens: int, prefix: int, head_dim: int, gqa: int, page_size: int) -> tuple:
    """The dispatch-table key of step_features (cls, batch, tokens, prefix) and the model's shape, under `bounds`."""
    return (cls, bisect_left(bounds["batch"], batch), bisect_left(bounds["tokens"], tokens),
            bisect_left(bounds["prefix"], prefix), int(head_dim), int(gqa), int(page_size))


def table_key(mode: str, batch_size: int, num_tokens: int, max_q_len: int, max_kv_len: int, head_dim: int, gqa: int,
              page_size: int) -> tuple:
    """The dispatch-table key of one step: FEATURES, with batch, tokens and prefix bucketed by BOUNDS
    (other bounds: `bucketed`, or DispatchTable.key)."""
    return bucketed(BOUNDS, *step_features(mode, batch_size, num_tokens, max_q_len, max_kv_len), head_dim, gqa, page_size)


@functools.lru_cache(maxsize=None)
def installed(backend: str) -> bool:
    """Whether `backend`'s module and the package it needs can be found (nothing is imported)."""
    caps = BACKENDS[backend]
    try:
        return all(importlib.util.find_spec(m) is not None for m in (caps.module, caps.package or caps.module))
    except (ImportError, ValueError):
        return False


@attrs.frozen
class DispatchTable:
    """A compiled dispatch table. choices: key (see `table_key`) -> backend name, for every
    measured key whose backend passed the capability and availability checks; caps: that
    backend's Capabilities. entries and source are the table file's, for reports."""

    bounds: Mapping = attrs.field(eq=False)
    choices: Mapping = attrs.field(eq=False)
    caps: Mapping = attrs.field(eq=False, repr=False)
    entries: tuple = attrs.field(default=(), eq=False, repr=False)
    source: Mapping = attrs.field(factory=dict, eq=False, repr=False)
    margin: float | None = None

    def key(self, mode: str, batch_size: int, num_tokens: int, max_q_len: int, max_kv_len: int, head_dim: int, gqa: int,
            page_size: int) -> tuple:
        return bucketed(self.bounds, *step_features(mode, batch_size, num_tokens, max_q_len, max_kv_len), head_dim, gqa,
                        page_size)


def empty_table_data() -> dict:
    """The JSON content of a table with no entries (FlashInfer everywhere)."""
    return {"version": TABLE_VERSION, "features": list(FEATURES), "bounds": {k: list(v) for k, v in BOUNDS.items()},
            "default": DEFAULT, "margin": None, "source": {}, "entries": []}


def _bounds(data: Mapping) -> dict:
    raw = data.get("bounds", BOUNDS)
    out = {}
    for name in ("batch", "tokens", "prefix"):
        b = raw.get(name) if isinstance(raw, Mapping) else None
        if not isinstance(b, (list, tuple)) or not b or not all(isinstance(x, int) and not isinstance(x, bool) for x in b) \
                or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"dispatch table: bounds[{name!r}] must be a non-empty increasing list of ints, got {b!r}")
        out[name] = tuple(b)
    return out


def compile_table(data: Mapping, available: Callable[[str], bool] | None = None) -> DispatchTable:
    """A DispatchTable from a table's JSON content (see `empty_table_data`, `tuning.derive_table`).

    Entries are dropped (the step then gets FlashInfer) when their backend is unknown, not
    `available` (default: `installed`), cannot serve the entry's mode class (a prefix-free
    backend outside "prefill", a backend without decode for "decode") or its head_dim.
    Raises ValueError on a malformed table.
    """
    if not isinstance(data, Mapping) or data.get("version") != TABLE_VERSION:
        raise ValueError(f"dispatch table: expected a mapping with version {TABLE_VERSION}, "
                         f"got version {data.get('version') if isinstance(data, Mapping) else type(data).__name__!r}")
    available = installed if available is None else available
    bounds = _bounds(data)
    entries = data.get("entries", [])
    if not isinstance(entries, list):
        raise ValueError("dispatch table: 'entries' must be a list")
    choices, caps = {}, {}
    for i, e in enumerate(entries):
        try:
            cls, name = e["mode"], e["backend"]
            key = (cls, int(e["batch"]), int(e["tokens"]), int(e["prefix"]), int(e["head_dim"]), int(e["gqa"]),
                   int(e["page_size"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"dispatch table: entries[{i}] needs {', '.join(FEATURES)} and backend ({err!r})") from None
        if cls not in _CLASS_MODES:
            raise ValueError(f"dispatch table: entries[{i}].mode must be one of {MODE_CLASSES}, got {cls!r}")
        c = BACKENDS.get(name)
        if c is None or not (_CLASS_MODES[cls] & c.modes) or (c.prefix_free and cls != "prefill") \
                or (c.head_dims is not None and key[4] not in c.head_dims) or not available(name):
            continue
        choices[key] = name
        caps[name] = c
    margin = data.get("margin")
    return DispatchTable(bounds, choices, caps, tuple(entries), dict(data.get("source") or {}),
                         None if margin is None else float(margin))


@functools.lru_cache(maxsize=8)
def load_table(path: str | None = None) -> DispatchTable:
    """The compiled table in `path` (default: the package's backend_table.json), read once and cached.

    A missing default table means no entries; a missing explicit path raises FileNotFoundError.
    """
    if path is None:
        if not TABLE_PATH.is_file():
            return compile_table(empty_table_data())
        path = str(TABLE_PATH)
    with open(path) as f:
        return compile_table(json.load(f))


def as_table(table) -> DispatchTable:
    """A DispatchTable from a DispatchTable, a table's JSON content (compiled now, uncached) or a path."""
    if isinstance(table, DispatchTable):
        return table
    if isinstance(table, Mapping):
        return compile_table(table)
    if isinstance(table, (str, os.PathLike)):
        return load_table(os.fspath(table))
    raise TypeError(f"table: expected a DispatchTable, a mapping or a path, got {type(table).__name__}")


def graph_backends(spec, table=None) -> tuple[str, ...]:
    """The backends an "auto" spec's decode and verify steps may get from the table (FlashInfer
    first): what DecodeGraphs captures for. table: as in select_backend."""
    if spec.mla:
        return (AUTO_MLA,)
    t = load_table() if table is None else as_table(table)
    picks = {n for n in t.choices.values()
             if n != DEFAULT and any(_serves(t.caps[n], spec, m, False) for m in ("decode", "verify"))}
    return (DEFAULT, *sorted(picks))


def spec_backends(spec) -> tuple[str, ...]:
    """The backends a spec's steps may take: its own, or with "auto" every one the table may pick."""
    return (spec.backend,) if spec.backend != AUTO else table_backends(spec)


def table_backends(spec, table=None) -> tuple[str, ...]:
    """Every backend the table may pick for some step of an "auto" spec (FlashInfer first): what a
    pool makes backend states (PoolState) for up front. table: as in select_backend."""
    if spec.mla:
        return (AUTO_MLA,)
    t = load_table() if table is None else as_table(table)
    picks = {n for n in t.choices.values() if n != DEFAULT and any(_serves(t.caps[n], spec, m, True) for m in MODE_CLASS)}
    return (DEFAULT, *sorted(picks))


def _serves(caps, spec, mode: str, prefix_free: bool) -> bool:
    return (mode in caps.modes and (prefix_free or not caps.prefix_free) and spec.dtype in caps.dtypes and caps.serves_kv(spec)
            and (caps.mla if spec.mla else not caps.mla_only)
            and (caps.head_dims is None or spec.head_dim in caps.head_dims)
            and not spec.soft_cap and all(g.kind is Kind.CAUSAL for g in spec.groups) and (caps.sinks or not spec.has_sinks))


def select_backend(spec, mode: str, batch_size: int, num_tokens: int, max_q_len: int, max_kv_len: int,
                   prefix_free: bool, table=None) -> str:
    """The backend name for one step. mode: a Mode value ("decode", "prefill", ...); prefix_free:
    every request's KV is new this step (ragged / varlen kernels may serve it). table: None for
    the package's table (`load_table()`), else anything `as_table` takes (pass a DispatchTable
    on a hot path: a mapping is compiled on every call)."""
    if spec.mla:  # the table is measured on standard attention; one GPU backend serves latent attention
        return AUTO_MLA
    t = load_table() if table is None else as_table(table)
    choices = t.choices
    if not choices:
        return DEFAULT
    if mode not in MODE_CLASS:
        return DEFAULT
    key = bucketed(t.bounds, *step_features(mode, batch_size, num_tokens, max_q_len, max_kv_len), spec.head_dim,
                    spec.gqa_group, spec.page_size)
    name = choices.get(key)
    if name is None or not _serves(t.caps[name], spec, mode, prefix_free):
        return DEFAULT
    return name


def resolve_backend(spec, mode, B: int, T: int, q_max: int, max_kv: int,
                    backend: str | None = None) -> str:
    """The backend serving a step of this shape: `backend`, else the spec's, or with "auto" the
    dispatcher's pick; PlanError when it cannot serve the step."""
    backend = backend or spec.backend
    cross = spec.has_cross  # (cross layers read the encoder's K/V, never only the step's)
    if backend == AUTO:
        backend = select_backend(spec, mode.value, B, T, q_max, max_kv, mode.value == "prefill" and not cross)
    key = (id(spec), mode, backend)  # (a pure function of these three: checked once per spec, mode and backend)
    if _SERVES.get(key) is spec:
        return backend
    caps = BACKENDS.get(backend)
    if caps is None:
        raise PlanError(f"backend: unknown backend {backend!r} (known: {sorted(BACKENDS)})")
    caps.check(spec, backend)
    if caps.prefix_free and cross:
        raise PlanError(f"backend: {backend!r} attends over the step's new K/V only; the spec's cross-attention layers "
                        "read the encoder's K/V from the cache (use a paged backend)")
    if mode.value not in caps.modes or (caps.prefix_free and mode.value != "prefill"):
        raise PlanError(f"backend: {backend!r} serves {sorted(caps.modes)} steps"
                        f"{' without a cached prefix' if caps.prefix_free else ''}, not this {mode.value} step")
    if len(_SERVES) >= 256:  # (bounded: the oldest entry goes)
        _SERVES.pop(next(iter(_SERVES), None), None)
    _SERVES[key] = spec  # (holding the spec keeps its id from being reused)
    return backend


_SERVES: dict[tuple, object] = {}  # (id(spec), mode, backend) -> spec, for the combinations resolve_backend passed
