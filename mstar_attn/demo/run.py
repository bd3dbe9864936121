"""The serving loop: `run_demo` serves the trace through the engine and checks it against transformers.

The model family is named here only (FAMILIES): `llama`, `gemma2`, `bart` or `gpt_oss`, modules with the same
surface (build_model, spec_fields, forward; gpt_oss adds layer_sinks). Layer groups with their own page lists (Gemma 2's window layers)
get a second page allocator: their pages are taken as requests grow and given back as the window passes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TextIO

import numpy as np
import torch
from torch._dynamo.utils import counters

from mstar_attn import AttentionSpec, CrossRows, GroupPages, PagedKVCache, StepBatch, build_plan, piecewise
from mstar_attn.demo import bart, gemma2, gpt_oss, llama
from mstar_attn.demo.attention import StepAttention, make_attention
from mstar_attn.demo.check import check_request, decoder_logits
from mstar_attn.demo.config import DTYPES, DemoConfig, DemoError
from mstar_attn.demo.engine import Engine, PageAllocator, drop_passed, grow_pages, make_trace, share_prefix
from mstar_attn.demo.report import DemoResult, PagesHeld, Progress, summary, write
from mstar_attn.warmup import kinds, warmup_model

FAMILIES = {"llama": llama, "gemma2": gemma2, "bart": bart, "gpt_oss": gpt_oss}
DENSE = {"reference": "reference", "flash_attn": "flash_attn_varlen"}  # the encoder's dense backend (else flashinfer_ragged)


def dense_backend(backend: str) -> str:
    """The backend of the encoder's dense path (no KV cache) beside the demo's `backend`."""
    return DENSE.get(backend, "flashinfer_ragged")


def model_spec(cfg: DemoConfig, family, model, num_pages: int, backend: str) -> AttentionSpec:
    """The AttentionSpec of a demo model (cfg resolved; family: one of FAMILIES' modules)."""
    fields = family.spec_fields(model)
    return AttentionSpec(cfg.heads, fields.pop("num_kv_heads", cfg.kv_heads), cfg.hidden // cfg.heads, cfg.page_size,
                         num_pages, dtype=DTYPES[cfg.dtype], backend=backend, cascade=cfg.cascade, **fields)


def run_demo(cfg: DemoConfig = DemoConfig(), *, attention: StepAttention | None = None, out: TextIO | None = None,
             progress: TextIO | None = None) -> DemoResult:
    """Serve the trace, check it against transformers, print a summary to `out` (None: silent) and the
    progress bar to `progress` (None: none).

    `attention` overrides the backend seam (tests pass a broken one to see the check fail).
    """
    cfg = cfg.resolve()
    if cfg.dtype not in DTYPES:
        raise DemoError(f"unknown dtype {cfg.dtype!r} (known: {', '.join(DTYPES)})")
    if cfg.compile not in ("off", "full", "piecewise"):
        raise DemoError(f"--compile {cfg.compile!r}: known modes are full (the default), piecewise and off")
    if min(cfg.requests, cfg.layers, cfg.page_size, cfg.hidden, cfg.window) < 1:
        raise DemoError("--requests, --layers, --hidden, --page-size and --window must be >= 1")
    family = FAMILIES.get(cfg.model)
    if family is None:
        raise DemoError(f"unknown model {cfg.model!r} (known: {', '.join(FAMILIES)})")
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    attn = attention or make_attention(cfg)
    rng = np.random.default_rng(cfg.seed)
    reqs = family.make_trace(cfg, rng) if hasattr(family, "make_trace") else make_trace(cfg, rng)
    ps = cfg.page_size
    num_pages = max(sum(-(-(len(r.prompt) + r.max_new) // ps) for r in reqs),  # enough with no sharing at all
                    sum(-(-len(r.encoder) // ps) for r in reqs))  # (an encoder-decoder's cross pages: their own ids)
    bar = Progress(progress, len(reqs))
    with torch.inference_mode():
        model = family.build_model(cfg, dtype, device)
        spec = model_spec(cfg, family, model, num_pages, attn.name)
        if cfg.gpu:  # every kernel the trace can reach, compiled now: none inside the timed steps
            bar.note(f"warming up {len(kinds(spec))} kinds of step ...")
            warm = warmup_model(spec, dense_backend(attn.name), device)  # (an encoder's dense kernel too)
            bar.note(f"warm-up: {warm.cold_s:.1f} s cold (compiling or loading kernels), {warm.warm_s * 1e3:.1f} ms warm")
        xg = next((g for g, group in enumerate(spec.groups) if group.cross), None)  # the cross-attention group
        own_groups = [g for g in spec.own_page_groups if g != xg]  # each on the one own list the engine keeps
        windows = [spec.groups[g].window for g in own_groups]
        window = None if None in windows else max(windows, default=0)  # None: an own list is never trimmed
        caches = [PagedKVCache.allocate(spec, device, group=g) for g in spec.layer_groups]
        for c in caches:
            c.k.zero_(), c.v.zero_()
        # the largest batch, as a power of two (the decode buckets), and the most tokens one step can have
        attn.bind(spec, 1 << (cfg.requests - 1).bit_length(), sum(len(r.prompt) for r in reqs) + len(reqs),
                  sum(len(r.encoder) for r in reqs) or None)
        sinks = family.layer_sinks(model) if hasattr(family, "layer_sinks") else None  # (gpt-oss: each layer's own)
        layers = attn.layers(spec, caches, sinks)  # the model's Attention layers, one per layer over its cache
        breaks = sum(counters["graph_break"].values())
        pieces = dict(piecewise.STATS)
        engine = Engine(family.forward, model, attn, layers, device, cfg.graphs, compile=cfg.compile)
        if cfg.graphs:
            bar.note("capturing the decode forward as CUDA graphs ...")
            engine.capture()  # before any request: capture's warm-up writes to page 0, which no one holds yet
            bar.note(f"captured {engine.num_graphs} graphs in {engine.capture_s:.1f} s")
        pages = PageAllocator(num_pages)
        own = PageAllocator(num_pages) if own_groups else None  # page ids of the own-list groups' caches
        held = PagesHeld(window, ps)
        cross = PageAllocator(num_pages) if xg is not None else None  # page ids of the cross layers' caches
        table = attn.cross_table  # None: steps list the cross pages; else they name the table's rows
        free_rows = [] if table is None else list(range(table.max_requests))
        served: dict[str, Counter] = {}
        plan_us, step_us, cascades = [], [], 0
        waiting, running, finished = deque(reqs), [], []
        step = 0
        while waiting or running:
            if not running and waiting[0].arrival > step:
                step = waiting[0].arrival  # idle: skip ahead to the next arrival
            t0 = time.perf_counter_ns()
            new = []
            while waiting and waiting[0].arrival <= step:
                r = waiting.popleft()
                new.append(r)
                if cross is None:
                    share_prefix(r, running, pages, ps, own, window)
                    continue
                r.cross_pages = cross.alloc(-(-len(r.encoder) // ps))  # its encoder K/V, stored at its first step
                if table is not None:
                    table.assign(free_rows[-1], r.cross_pages)
                    r.cross_row = free_rows.pop()
            batch = [(running + new)[i] for i in rng.permutation(len(running) + len(new))]  # order is free
            for r in batch:
                grow_pages(r, pages, own, ps)
            lists = GroupPages.from_pages([r.own_first for r in batch], [r.own_pages for r in batch]) if own else None
            group_pages = {g: lists for g in own_groups}
            if xg is not None:
                enc, stores = [len(r.encoder) for r in batch], [r.cached == 0 for r in batch]
                group_pages[xg] = (GroupPages.cross([r.cross_pages for r in batch], enc, stores) if table is None
                                   else CrossRows.of([r.cross_row for r in batch], enc, stores))
            step_batch = StepBatch.from_pages([len(r.tokens) - r.cached for r in batch], [len(r.tokens) for r in batch],
                                              [r.pages for r in batch], ps, group_pages)
            t1 = time.perf_counter_ns()
            plan = build_plan(step_batch, spec)
            t2 = time.perf_counter_ns()
            encode = None if xg is None else lambda ctx: family.encode(  # noqa: E731
                model, ctx, layers, [r.encoder for r in batch if r.cached == 0], dense_backend(attn.name))
            logits = engine(plan, [t for r in batch for t in r.tokens[r.cached :]], encode).float()
            last = logits[torch.from_numpy(plan.qo_indptr[1:] - 1).to(device).long()].argmax(-1).tolist()
            rows = logits.cpu()
            for i, (r, tok) in enumerate(zip(batch, last)):
                r.logits.append(rows[plan.qo_indptr[i] : plan.qo_indptr[i + 1]])
                r.cached = len(r.tokens)
                r.tokens.append(tok)
                if own is not None and window is not None:
                    drop_passed(r, own, window, ps)
                if r.done:
                    pages.release(r.pages)
                    if own is not None:
                        own.release(r.own_pages)
                    if cross is not None:
                        cross.release(r.cross_pages)
                    if table is not None:
                        table.release(r.cross_row)
                        free_rows.append(r.cross_row)
                    finished.append(r)
            running = [r for r in batch if not r.done]
            if own is not None:
                held.after_step(running, pages, own)
            served.setdefault(plan.backend, Counter())[plan.mode.value] += 1
            cascades += plan.cascade is not None
            plan_us.append((t2 - t1) / 1e3)
            step_us.append((time.perf_counter_ns() - t0) / 1e3 - engine.aside_us)
            step += 1
            bar.update(len(finished), step)
        bar.close(len(finished), step)
        logits_of = getattr(family, "logits_of", decoder_logits)
        checks = [check_request(model, r, dtype, logits_of) for r in sorted(finished, key=lambda r: r.rid)]
    result = DemoResult(
        config=cfg, steps=len(step_us), prompt_tokens=sum(len(r.prompt) for r in reqs),
        shared_tokens=sum(r.shared for r in reqs), prefix_hits=sum(r.shared > 0 for r in reqs),
        generated_tokens=sum(r.max_new for r in reqs), served=served, pages_reused=pages.reused, plan_us=plan_us,
        step_us=step_us, checks=checks, commit_us=engine.commit_us, graph_us=engine.graph_us, eager_us=engine.eager_us,
        replayed_steps=engine.replayed,
        num_graphs=engine.num_graphs, capture_s=engine.capture_s, tokens={r.rid: r.tokens for r in reqs},
        pages_held=held if own is not None else None, encoder_tokens=sum(len(r.encoder) for r in reqs),
        cross_rows=table is not None, cascade_steps=cascades, compile_s=engine.compile_s,
        graph_breaks=sum(counters["graph_break"].values()) - breaks,
        piece_graphs=piecewise.STATS["captured"] - pieces["captured"], piece_replays=piecewise.STATS["replayed"] - pieces["replayed"],
    )
    if out is not None:
        write(out, summary(result))
    return result
