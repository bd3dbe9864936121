"""select_backend and the dispatch table (CPU): lookup, bucketing, fallback, capability safety."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_attn import AttentionSpec, LayerGroup, StepBatch, build_plan
from mstar_attn.kernels import BACKENDS
from mstar_attn.metadata import select
from mstar_attn.metadata.select import (
    DEFAULT, DispatchTable, bucket_labels, compile_table, empty_table_data, graph_backends, load_table, select_backend,
    table_key,
)

ALL = lambda name: True  # noqa: E731  every backend counts as installed


def spec(hq=32, hkv=8, d=128, ps=16, dtype=torch.bfloat16, **kw):
    return AttentionSpec(hq, hkv, d, ps, 4096, dtype=dtype, backend="auto", **kw)


def entry(backend, mode="decode", batch=3, tokens=0, prefix=2, head_dim=128, gqa=4, page_size=16):
    return dict(mode=mode, batch=batch, tokens=tokens, prefix=prefix, head_dim=head_dim, gqa=gqa, page_size=page_size,
                backend=backend)


def table(*entries, available=ALL, **extra):
    data = empty_table_data()
    data["entries"] = list(entries)
    data.update(extra)
    return compile_table(data, available=available)


GRID = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "backend_grid.json"


def test_the_shipped_table_is_valid_and_read_once():
    data = json.loads(select.TABLE_PATH.read_text())
    assert data["version"] == select.TABLE_VERSION and data["source"]["results"] == GRID.name
    assert load_table() is load_table()  # read once, cached
    everything = compile_table(data, available=ALL)
    assert set(everything.choices.values()) <= set(BACKENDS) and DEFAULT in everything.choices.values()


def test_regression_pin_shipped_table_on_the_grid_it_was_derived_from():
    """A regression pin, not an acceptance: the shipped table was derived from this grid (the committed
    H100 measurements), and per shape the backend it picks is within 3% of the fastest and never slower
    than FlashInfer paged beyond the shape's measured round-to-round spread. Shapes outside the grid
    have not been measured yet."""
    grid = json.loads(GRID.read_text())
    table = compile_table(json.loads(select.TABLE_PATH.read_text()), available=ALL)  # as on a GPU machine
    checked = 0
    for rec in grid["shapes"]:
        times = {n: r["median_us"] for n, r in rec["results"].items() if r.get("status") == "ok"}
        spread = max(r["spread"] for n, r in rec["results"].items() if n in times)
        s, p = rec["spec"], rec["plan"]
        sp = AttentionSpec(s["num_qo_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"], s["num_pages"], backend="auto")
        choice = select_backend(sp, p["mode"], p["batch_size"], p["num_tokens"], p["max_q_len"], p["max_kv_len"],
                                p["mode"] == "prefill", table=table)
        assert times[choice] <= 1.03 * min(times.values()), (rec["name"], choice, times)
        assert times[choice] <= times["flashinfer"] * (1 + spread), (rec["name"], choice, times)
        checked += 1
    assert checked == len(grid["shapes"]) >= 30


HELD_OUT = GRID.with_name("backend_grid_heldout_h100.json")


def test_shipped_table_on_held_out_shapes():
    """The acceptance: H100 measurements of shapes the table was not derived from (query / KV heads 24/6 and
    40/5 where the grid had 32/8 and 16/2; `python -m benchmarks.backend_grid OUT --heads 24/6,40/5`). Per
    shape the backend the shipped table picks is within 10% of the fastest and of FlashInfer paged (the
    default it replaces), and over all shapes within 2% of the fastest (geometric mean). A shape whose round
    medians spread more than that 10% cannot decide it and is left out (one: a 447 µs round among 22 µs
    ones). Measured: worst 1.067x (decode B=32 ctx=512 h40/5, FA4 picked, FlashInfer fastest), 40 of 42
    within 3%."""
    grid, held = json.loads(GRID.read_text()), json.loads(HELD_OUT.read_text())
    seen = {tuple(r["shape"]["heads"]) for r in grid["shapes"]}
    table = compile_table(json.loads(select.TABLE_PATH.read_text()), available=ALL)  # as on a GPU machine
    ratios = []
    for rec in held["shapes"]:
        assert tuple(rec["shape"]["heads"]) not in seen, rec["name"]  # (held out: never in the derivation grid)
        times = {n: r["median_us"] for n, r in rec["results"].items() if r.get("status") == "ok"}
        if max(r["spread"] for n, r in rec["results"].items() if n in times) > 0.10:
            continue  # (too noisy to decide a 10% bound)
        s, p = rec["spec"], rec["plan"]
        sp = AttentionSpec(s["num_qo_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"], s["num_pages"], backend="auto")
        choice = select_backend(sp, p["mode"], p["batch_size"], p["num_tokens"], p["max_q_len"], p["max_kv_len"],
                                p["mode"] == "prefill", table=table)
        assert times[choice] <= 1.10 * min(times.values()), (rec["name"], choice, times)
        assert times[choice] <= 1.10 * times["flashinfer"], (rec["name"], choice, times)
        ratios.append(times[choice] / min(times.values()))
    assert len(ratios) >= 30 and float(np.exp(np.mean(np.log(ratios)))) <= 1.02, sorted(ratios)[-5:]


def test_bucketing():
    assert bucket_labels((1, 4, 16)) == ["1", "2-4", "5-16", ">16"]
    assert bucket_labels((0, 1024)) == ["0", "1-1024", ">1024"]
    b = [table_key("decode", n, n, 1, 100, 128, 4, 16)[1] for n in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257, 10**6)]
    assert b == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    # tokens per request: the ceiling of the mean
    assert table_key("prefill", 4, 32, 8, 8, 128, 4, 16)[2] == 1  # 8 per request
    assert table_key("prefill", 4, 33, 9, 9, 128, 4, 16)[2] == 2  # 9 (ceil 8.25)
    # prefix: 0 for prefill whatever the lengths; max_kv - max_q otherwise
    assert table_key("prefill", 2, 100, 50, 50, 128, 4, 16)[3] == 0
    assert table_key("decode", 2, 2, 1, 1025, 128, 4, 16)[3] == 1  # prefix 1024
    assert table_key("decode", 2, 2, 1, 1026, 128, 4, 16)[3] == 2
    assert table_key("extend", 2, 100, 60, 60, 128, 4, 16)[3] == 0
    # mode classes
    assert {table_key(m, 2, 8, 4, 100, 128, 4, 16)[0] for m in ("extend", "mixed", "verify")} == {"extend"}
    assert table_key("decode", 1, 1, 1, 9, 64, 8, 32)[4:] == (64, 8, 32)


def test_a_hand_made_table_chooses_what_it_says():
    t = table(entry("flash_attn"), entry("flash_attn_varlen", mode="prefill", batch=2, tokens=4, prefix=0),
              entry("flash_attn", mode="extend", batch=3, tokens=1, prefix=2), entry("flashinfer", batch=4))
    s = spec()
    assert select_backend(s, "decode", 32, 32, 1, 3000, False, t) == "flash_attn"  # batch 17-64, prefix 1025-4096
    assert select_backend(s, "decode", 16, 16, 1, 3000, False, t) == DEFAULT  # batch 5-16: not in the table
    assert select_backend(s, "decode", 100, 100, 1, 3000, False, t) == DEFAULT  # says flashinfer
    assert select_backend(s, "decode", 32, 32, 1, 5000, False, t) == DEFAULT  # prefix 4097-16384
    assert select_backend(s, "prefill", 8, 8 * 1000, 1000, 1000, True, t) == "flash_attn_varlen"
    assert select_backend(s, "verify", 32, 128, 4, 2000, False, t) == "flash_attn"
    assert select_backend(s, "mixed", 32, 100, 40, 2000, False, t) == "flash_attn"  # ceil(100/32) = 4 tokens
    # the other features: fp16 is served too; another head_dim, GQA ratio or page size is not in the table
    assert select_backend(spec(dtype=torch.float16), "decode", 32, 32, 1, 3000, False, t) == "flash_attn"
    assert select_backend(spec(d=64), "decode", 32, 32, 1, 3000, False, t) == DEFAULT
    assert select_backend(spec(hkv=32), "decode", 32, 32, 1, 3000, False, t) == DEFAULT
    assert select_backend(spec(ps=128), "decode", 32, 32, 1, 3000, False, t) == DEFAULT
    # a table passed as JSON content or as a file works the same
    data = empty_table_data() | {"entries": [entry("flashinfer_ragged", mode="prefill", batch=0, tokens=3, prefix=0)]}
    expect = "flashinfer_ragged" if select.installed("flashinfer_ragged") else DEFAULT  # mappings: installed() decides
    assert select_backend(s, "prefill", 1, 500, 500, 500, True, data) == expect


def test_table_from_a_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(empty_table_data() | {"entries": [entry("flashinfer")]}))
    assert isinstance(load_table(str(path)), DispatchTable)
    assert select_backend(spec(), "decode", 32, 32, 1, 3000, False, str(path)) == DEFAULT
    with pytest.raises(FileNotFoundError):
        load_table(str(tmp_path / "missing.json"))


def test_prefix_free_backends_only_serve_prefix_free_prefill():
    s = spec()
    t = table(entry("flash_attn_varlen", mode="prefill", batch=2, tokens=4, prefix=0),
              entry("flashinfer_ragged", mode="decode"), entry("flash_attn_varlen", mode="extend", batch=3, tokens=1, prefix=2))
    assert select_backend(s, "prefill", 8, 8000, 1000, 1000, True, t) == "flash_attn_varlen"
    assert select_backend(s, "prefill", 8, 8000, 1000, 1000, False, t) == DEFAULT  # caller says: not prefix-free
    assert select_backend(s, "decode", 32, 32, 1, 3000, False, t) == DEFAULT  # dropped at compile
    assert select_backend(s, "verify", 32, 128, 4, 2000, False, t) == DEFAULT  # dropped at compile
    assert set(t.choices.values()) == {"flash_attn_varlen"}


def test_incapable_unknown_or_missing_backends_fall_back():
    s = spec(d=256)
    t = table(entry("flash_attn", head_dim=256), entry("no_such_backend", batch=4))
    assert not t.choices  # FA serves head dims 64/96/128; unknown names are ignored
    assert select_backend(s, "decode", 32, 32, 1, 3000, False, t) == DEFAULT
    missing = table(entry("flash_attn"), available=lambda name: name != "flash_attn")
    assert select_backend(spec(), "decode", 32, 32, 1, 3000, False, missing) == DEFAULT
    t = table(entry("flash_attn"))
    # measured on causal full attention without soft-capping: other layer patterns keep FlashInfer
    for other in (spec(soft_cap=30.0), spec(groups=(LayerGroup(), LayerGroup("window", window=128)), layer_groups=(0, 1)),
                  spec(groups=(LayerGroup("noncausal"),))):
        assert select_backend(other, "decode", 32, 32, 1, 3000, False, t) == DEFAULT


def test_malformed_tables_raise():
    with pytest.raises(ValueError, match="version"):
        compile_table({"version": 99})
    with pytest.raises(ValueError, match="bounds"):
        compile_table(empty_table_data() | {"bounds": {"batch": [4, 1], "tokens": [1], "prefix": [0]}})
    with pytest.raises(ValueError, match="entries\\[0\\]"):
        compile_table(empty_table_data() | {"entries": [{"mode": "decode", "backend": "flash_attn"}]})
    with pytest.raises(ValueError, match="mode"):
        compile_table(empty_table_data() | {"entries": [entry("flash_attn", mode="sideways")]})
    with pytest.raises(TypeError):
        select_backend(spec(), "decode", 1, 1, 1, 10, False, table=42)


def test_installed_checks_without_importing():
    assert select.installed("reference")
    assert isinstance(select.installed("flash_attn"), bool)


MODES = ["decode", "prefill", "extend", "mixed", "verify"]


@st.composite
def features(draw):
    mode = draw(st.sampled_from(MODES))
    B = draw(st.integers(1, 600))
    q = 1 if mode == "decode" else draw(st.integers(1, 9000))
    T = B if mode == "decode" else draw(st.integers(max(B, q), max(B, q) + B * q))
    kv = q if mode == "prefill" else q + draw(st.integers(0, 40000))
    return mode, B, T, q, kv


@given(
    st.lists(st.tuples(st.sampled_from([*BACKENDS, "nope"]), st.sampled_from(["decode", "prefill", "extend"]),
                       st.integers(0, 5), st.integers(0, 5), st.integers(0, 4), st.sampled_from([64, 96, 128, 256]),
                       st.sampled_from([1, 4, 8]), st.sampled_from([1, 16, 128])), max_size=30),
    st.lists(features(), min_size=1, max_size=20),
    st.sampled_from([64, 128, 256]), st.sampled_from([(32, 8), (32, 32), (16, 2)]), st.sampled_from([1, 16, 128]),
    st.sampled_from([torch.bfloat16, torch.float16]), st.booleans(), st.booleans(),
)
def test_never_returns_a_backend_that_cannot_serve_the_step(raw, steps, d, heads, ps, dtype, hit, prefix_free_any):
    s = spec(heads[0], heads[1], d, ps, dtype)
    entries = [entry(b, m, *rest) for b, m, *rest in raw]
    if hit:  # make the table hit the drawn steps, with any backend at all
        names = [*BACKENDS]
        for i, (mode, B, T, q, kv) in enumerate(steps):
            k = table_key(mode, B, T, q, kv, d, heads[0] // heads[1], ps)
            entries.append(dict(zip(("mode", "batch", "tokens", "prefix", "head_dim", "gqa", "page_size"), k),
                                backend=names[i % len(names)]))
    t = table(*entries)
    for mode, B, T, q, kv in steps:
        prefix_free = mode == "prefill" and prefix_free_any
        name = select_backend(s, mode, B, T, q, kv, prefix_free, t)
        caps = BACKENDS[name]
        assert mode in caps.modes
        assert prefix_free or not caps.prefix_free
        assert s.dtype in caps.dtypes and (caps.head_dims is None or d in caps.head_dims)
        key = table_key(mode, B, T, q, kv, d, heads[0] // heads[1], ps)
        assert name == t.choices.get(key, DEFAULT) or name == DEFAULT  # the table's choice, or the fallback


def test_build_plan_with_auto_takes_the_backend_from_the_table(monkeypatch):
    t = table(entry("flash_attn", mode="decode", batch=1, tokens=0, prefix=1, head_dim=128, gqa=4, page_size=16),
              entry("flash_attn_varlen", mode="prefill", batch=1, tokens=3, prefix=0))
    monkeypatch.setattr(select, "load_table", lambda path=None: t)
    s = AttentionSpec(32, 8, 128, 16, 64, dtype=torch.bfloat16, backend="auto")

    def batch(q, kv):
        need = [-(-k // 16) for k in kv]
        return StepBatch.from_csr(q, kv, np.concatenate([[0], np.cumsum(need)]), np.arange(sum(need)), 16)

    assert build_plan(batch([1, 1], [100, 200]), s).backend == "flash_attn"  # decode, B 2, prefix <= 1024
    assert build_plan(batch([1] * 5, [100] * 5), s).backend == DEFAULT  # B 5: another bucket
    assert build_plan(batch([100, 90], [100, 90]), s).backend == "flash_attn_varlen"  # prefill, 95 tokens each
    assert build_plan(batch([100, 90], [150, 90]), s).backend == DEFAULT  # extend: not in the table


def test_graph_backends_are_the_ones_the_table_can_pick_for_decode_and_verify():
    table = compile_table(json.loads(select.TABLE_PATH.read_text()), available=ALL)
    assert graph_backends(spec(), table) == ("flashinfer", "flash_attn")  # the H100 table picks FA4 for some decodes
    assert graph_backends(spec(d=256), table) == ("flashinfer",)  # FA4 does not serve head_dim 256
    windowed = spec(groups=(LayerGroup(), LayerGroup("window", window=64)))
    assert graph_backends(windowed, table) == ("flashinfer",)  # the table measured plain causal layers only
    assert graph_backends(spec(), compile_table(empty_table_data(), available=ALL)) == ("flashinfer",)
