"""The measurement: every shape of the grid on every backend that can serve it, side by side, checked first."""

from __future__ import annotations

import datetime
import importlib.metadata
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from mstar_attn.metadata.backends import BACKENDS
from mstar_attn.tuning.grid import FLUSH_BYTES, GRID_BACKENDS, TOL, Shape, _cost, _groups, make_batch
from mstar_attn.tuning.render import RESULTS_KIND, _fmt_us, _status_word, _write_json
from mstar_attn.tuning.table import RESULTS_NAME, _ok
from mstar_attn.tuning.timing import _ceilings, _Timer, host_median_us

RESULTS_VERSION = 1


class _Fatal(RuntimeError):
    """The CUDA context is unusable (a sticky error): stop the grid, keep what was measured."""


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _versions() -> dict:
    out = {}
    for dist in ("torch", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    import torch

    import mstar_attn

    out["torch"] = torch.__version__  # the imported one, whatever the metadata says
    out["cuda"] = torch.version.cuda
    out["mstar_attn"] = mstar_attn.__version__
    return out


@attrs.frozen
class BenchConfig:
    rounds: int = 3
    reps: int = 20
    warmup: int = 3
    commit_reps: int = 30
    flush_bytes: int = FLUSH_BYTES
    tol: float = TOL
    seed: int = 0


def _capable(name: str, mode: str, spec_kw: dict):
    """The AttentionSpec for backend `name`, or None when its registry entry can't serve the step."""
    from mstar_attn.metadata.spec import AttentionSpec, PlanError

    caps = BACKENDS[name]
    if mode not in caps.modes or (caps.prefix_free and mode != "prefill"):
        return None
    try:
        return AttentionSpec(**spec_kw, backend=name)
    except PlanError:
        return None


def run_grid(shapes: list[Shape], out_dir: Path, cfg: BenchConfig = BenchConfig(), log: Callable = print, *,
             device: str = "cuda", timer=None, ceilings: Mapping | None = None) -> dict:
    """Measure every shape on every backend that can serve it; returns (and keeps writing to
    out_dir/backend_grid.json) the results. Raises _Fatal after saving if CUDA breaks.
    device / timer / ceilings: the GPU and its measurements unless given (tests pass a CPU
    device with a host timer to run the whole pipeline without a GPU)."""
    import torch

    out_dir = Path(out_dir)
    t_start = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name()
        info = {"sm_count": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}"}
    else:
        name, info = f"{device} (no GPU: a pipeline test, not a measurement)", {}
    results = {
        "kind": RESULTS_KIND, "version": RESULTS_VERSION, "device": name, "device_info": info,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "host": {"python": sys.version.split()[0], "argv": sys.argv},
        "method": {**attrs.asdict(cfg), "timed": "kernels.write_kv + kernels.run, one layer",
                   "l2": "flushed before every repetition", "queued_behind_sleep": cuda and hasattr(torch.cuda, "_sleep")},
        "unavailable": {}, "shapes": [],
    }
    results["ceilings"] = c = dict(ceilings) if ceilings is not None else _ceilings()
    log(f"device {results['device']}: copy {c['copy_TBps']:.2f} TB/s, bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s; "
        f"{len(shapes)} shapes")
    timer = _Timer(cfg.flush_bytes) if timer is None else timer
    path = out_dir / f"{RESULTS_NAME}.json"
    try:
        for group in _groups(shapes).values():
            _run_group(group, results, timer, cfg, log, lambda: _write_json(results, path), device)
    finally:
        results["wall_s"] = round(time.perf_counter() - t_start, 1)
        _write_json(results, path)
    return results


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _cuda_ok(device="cuda") -> bool:
    try:
        _sync(device)
        return True
    except Exception:  # noqa: BLE001  a sticky CUDA error surfaces as a RuntimeError (or AcceleratorError)
        return False


def _run_group(group: list[Shape], results: dict, timer, cfg: BenchConfig, log, save, device: str) -> None:
    import torch

    from mstar_attn import kernels
    from mstar_attn.cache import PagedKVCache
    from mstar_attn.capture.limits import PoolLimits
    from mstar_attn.capture.pool import GraphBufferPool
    from mstar_attn.kernels import reference
    from mstar_attn.metadata.plan import build_plan
    from mstar_attn.metadata.spec import AttentionSpec

    hq, hkv, d, ps, dtype_name = group[0].group
    dtype = getattr(torch, dtype_name)
    num_pages = 1 + max(s.max_pages for s in group) + 8
    spec_kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=num_pages, dtype=dtype)
    limits = PoolLimits(max_batch_size=max(256, max(s.max_requests for s in group)),
                        max_num_tokens=max(s.max_tokens for s in group), max_num_pages=num_pages,
                        max_pages_per_request=max(s.max_pages_per_request for s in group))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shape5 = (num_pages + 1, ps, hkv, d)  # + the scratch page
    cache = PagedKVCache(torch.randn(shape5, device=device, dtype=dtype, generator=gen),
                         torch.randn(shape5, device=device, dtype=dtype, generator=gen), finite=True)  # randn: finite
    ref_spec = AttentionSpec(**spec_kw, backend="reference")
    pools: dict[str, object] = {}
    unavailable = results["unavailable"]

    def pool_for(name: str, spec):
        if name not in pools:
            pools[name] = GraphBufferPool(spec, limits, device=device)
        return pools[name]

    try:
        for i, shape in enumerate(group):
            seed = cfg.seed * 1000 + len(results["shapes"])
            batch = make_batch(shape, num_pages, seed)
            plan0 = build_plan(batch, ref_spec)
            mode = plan0.mode.value
            if mode != shape.kind:
                raise ValueError(f"grid: {shape.name} planned as {mode}, not {shape.kind}")
            T = plan0.num_tokens
            nbytes, flops = _cost(plan0.q_lens, plan0.kv_lens, hq, hkv, d, torch.finfo(dtype).bits // 8)
            c = results["ceilings"]
            floor_us = max(nbytes / (c["copy_TBps"] * 1e12), flops / (c["matmul_TFLOPs"] * 1e12)) * 1e6
            q = torch.randn(T, hq, d, device=device, dtype=dtype, generator=gen)
            k = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
            v = torch.randn(T, hkv, d, device=device, dtype=dtype, generator=gen)
            reference.write_kv(plan0, k, v, cache)
            ref = reference.run(plan0, q.float(), cache)  # float32 arithmetic over the same bf16 cache
            rec = {"name": shape.name, "shape": attrs.asdict(shape), "spec": {**{k_: v_ for k_, v_ in spec_kw.items() if k_ != "dtype"},
                   "dtype": dtype_name}, "plan": {"mode": mode, "batch_size": plan0.batch_size, "num_tokens": T,
                   "max_q_len": plan0.max_q_len, "max_kv_len": plan0.max_kv_len},
                   "bytes": nbytes, "flops": flops, "floor_us": floor_us, "results": {}}
            live, case = {}, _Case(batch, q, k, v, cache, ref, T, device)
            for name in GRID_BACKENDS:
                spec = _capable(name, mode, spec_kw)
                if spec is None:
                    continue
                if name in unavailable:
                    rec["results"][name] = {"status": unavailable[name]}
                    continue
                try:
                    kernels.get_backend(name)
                    pool = pool_for(name, spec)
                except ImportError as e:  # the backend's package is missing: say so once, skip it everywhere
                    unavailable[name] = f"unavailable: {_short(e)}"
                    rec["results"][name] = {"status": unavailable[name]}
                    continue
                except Exception as e:  # noqa: BLE001  recorded, the grid goes on
                    rec["results"][name] = {"status": f"error: {_short(e)}"}
                    if not _cuda_ok(device):
                        raise _Fatal(f"{shape.name}, {name}: {_short(e)}") from e
                    continue
                try:
                    rec["results"][name], fn = _prepare(name, pool, spec, case, cfg)
                    if fn is not None:
                        live[name] = fn
                except Exception as e:  # noqa: BLE001
                    rec["results"][name] = {"status": f"error: {_short(e)}"}
                    if not _cuda_ok(device):
                        raise _Fatal(f"{shape.name}, {name}: {_short(e)}") from e
            del ref, case
            try:
                _time_interleaved(live, rec["results"], timer, cfg)
            except Exception as e:  # noqa: BLE001
                for name in live:
                    rec["results"][name].setdefault("median_us", None)
                    rec["results"][name]["status"] = f"error: {_short(e)}"
                if not _cuda_ok(device):
                    raise _Fatal(f"{shape.name}, timing: {_short(e)}") from e
            for a in rec["results"].values():
                if _ok(a):
                    a["floor_fraction"] = round(floor_us / a["median_us"], 4)
            results["shapes"].append(rec)
            save()
            ok = {n: a["median_us"] for n, a in rec["results"].items() if _ok(a)}
            best = min(ok, key=ok.__getitem__) if ok else "-"
            log(f"[{len(results['shapes'])}] {shape.name}: " + ", ".join(
                f"{n} {_fmt_us(a['median_us'])}" if _ok(a) else f"{n} {_status_word(a)}" for n, a in rec["results"].items())
                + f"  -> {best}")
    finally:
        pools.clear()
        del cache
        torch.cuda.empty_cache()


@attrs.frozen
class _Case:
    """One grid shape's inputs, shared by every backend: the batch, q [T, hq, d], k and v [T, hkv, d] on
    `device`, the cache they are written to, and the float32 reference output [T, hq, d]."""

    batch: object
    q: object
    k: object
    v: object
    cache: object
    ref: object
    num_tokens: int
    device: object


def _prepare(name, pool, spec, case: _Case, cfg: BenchConfig):
    """Commit, run once (JIT), check against the reference, time the host commit, warm up.
    Returns (record, fn or None)."""
    batch, q, k, v, cache, ref, T, device = (case.batch, case.q, case.k, case.v, case.cache, case.ref, case.num_tokens,
                                             case.device)
    import torch

    from mstar_attn import kernels
    from mstar_attn.metadata.plan import build_plan

    plan = build_plan(batch, spec)
    t0 = time.perf_counter()
    step = pool.commit(plan)
    kernels.write_kv(step, k, v, cache)
    out = kernels.run(step, q, cache, 0, k, v)
    _sync(device)
    first_s = time.perf_counter() - t0
    kernel = sorted({type(x).__name__ for x in step.scheduled if x is not None})
    rec = {"first_call_s": round(first_s, 3), "kernel": kernel}
    if name.endswith("_ragged") and not any("Ragged" in x for x in kernel):
        rec["status"] = f"error: FlashInfer's pool state planned {kernel} for plan.backend={name!r}, not ragged attention"
        return rec, None
    if out.shape[0] < T:
        rec["status"] = f"mismatch: run returned {out.shape[0]} rows for {T} tokens"
        return rec, None
    out = out[:T].float()
    if not torch.isfinite(out).all():
        rec["status"] = "mismatch: non-finite output"
        return rec, None
    err = ((out - ref).norm() / ref.norm()).item()
    rec["rel_err"] = err
    if not err < cfg.tol:
        rec["status"] = f"mismatch: norm-relative error {err:.2e} vs the float32 reference (tol {cfg.tol:.0e})"
        return rec, None
    rec["commit_us"] = round(host_median_us(lambda: pool.commit(plan), cfg.commit_reps), 2)
    step = pool.commit(plan)
    _sync(device)

    def fn():
        kernels.write_kv(step, k, v, cache)
        kernels.run(step, q, cache, 0, k, v)

    host = []
    for _ in range(cfg.warmup):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    rec["host_launch_us"] = round(statistics.median(host), 2)
    rec["status"] = "ok"
    return rec, fn


def _time_interleaved(live: dict, records: dict, timer: _Timer, cfg: BenchConfig) -> None:
    names = list(live)
    samples = {n: [] for n in names}
    rounds = {n: [] for n in names}
    queued = {n: [] for n in names}
    if not names:
        return
    for r in range(cfg.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:  # rotated: no backend always goes first
            host_us = records[n]["host_launch_us"]
            for attempt in range(3):
                xs, q = timer.round(live[n], cfg.reps, host_us * (2**attempt))
                if q or not timer.can_sleep:
                    break
            samples[n] += xs
            rounds[n].append(statistics.median(xs))
            queued[n].append(q)
    for n in names:
        med = statistics.median(samples[n])
        records[n].update(median_us=med, round_medians_us=[round(x, 3) for x in rounds[n]],
                          spread=(max(rounds[n]) - min(rounds[n])) / med, queued=all(queued[n]),
                          min_us=min(samples[n]), samples_us=[round(x, 2) for x in samples[n]])
