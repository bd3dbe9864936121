"""The engine loop's pieces: pages, requests, the trace, and one step's forward (eager or replayed, timed).

Model-agnostic: the step's forward is the model adapter's `forward(model, ctx, layers, ids, positions)`
(see `llama.py`), handed to Engine by `run.run_demo`; its attention layers are `mstar_attn.Attention`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs
import numpy as np
import torch
from torch._dynamo.utils import counters

from mstar_attn import Attention, AttentionPlan, Mode, step_context
from mstar_attn.demo.attention import StepAttention
from mstar_attn.demo.config import DemoConfig, DemoError
from mstar_attn import piecewise

# ----------------------------------------------------------------------------------------------------
# Pages and requests.


class PageAllocator:
    """LIFO free list of page ids with reference counts (a shared prefix page is held by several
    requests). `reused` counts allocations of pages some earlier request had already used."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = np.zeros(num_pages, np.int32)
        self.seen = np.zeros(num_pages, np.bool_)
        self.reused = 0

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise DemoError(f"out of KV pages: need {n}, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(n)]
        self.reused += int(self.seen[pages].sum())
        self.seen[pages] = True
        self.refs[pages] = 1
        return pages

    @property
    def held(self) -> int:
        """Pages held now (a page several requests share counts once)."""
        return self.num_pages - len(self.free)

    def share(self, pages: list[int]) -> None:
        self.refs[pages] += 1

    def release(self, pages: list[int]) -> None:
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)


@attrs.define
class Request:
    """One sequence. tokens = prompt + generated; the KV of tokens[:cached] is in `pages`.

    The first `shared` tokens' pages came from another request (whole pages, read-only). `logits`
    holds the engine's rows for positions shared .. len(tokens) - 2, float32 on the CPU, [n, vocab].
    own_pages: the page list of the layer groups with their own (a window group): the pages of
    logical pages own_first, own_first + 1, ... (those before it were given back, see `drop_passed`).
    An encoder-decoder request also has `encoder` input; its encoder K/V sit on `cross_pages`.
    """

    rid: int
    arrival: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = attrs.field(init=False)
    pages: list[int] = attrs.Factory(list)
    cached: int = 0
    shared: int = 0
    logits: list[torch.Tensor] = attrs.Factory(list)
    own_first: int = 0
    own_pages: list[int] = attrs.Factory(list)
    encoder: list[int] = attrs.Factory(list)  # an encoder-decoder's encoder input (token ids); [] otherwise
    cross_pages: list[int] = attrs.Factory(list)  # the pages of its encoder K/V (cross-attention layers)
    cross_row: int = -1  # their row in the pool's cross table, when the seam has one

    def __attrs_post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new


def make_trace(cfg: DemoConfig, rng: np.random.Generator) -> list[Request]:
    """Requests 0 and 1 arrive at step 0, then one every 1-3 steps. Two of every three prompts open
    with one of two shared "system prompts" (13 and 7 tokens); prompts are 3-24 tokens long and
    each request generates 3-14 tokens."""
    systems = [rng.integers(0, cfg.vocab, n).tolist() for n in (13, 7)]
    reqs, step = [], 0
    for i in range(cfg.requests):
        step += 0 if i < 2 else int(rng.integers(1, 4))
        head = systems[i % 2] if i % 3 != 2 else []
        own = rng.integers(0, cfg.vocab, int(rng.integers(max(1, 3 - len(head)), 25 - len(head)))).tolist()
        reqs.append(Request(i, step, head + own, int(rng.integers(3, 15))))
    return reqs


def share_prefix(req: Request, live: list[Request], pages: PageAllocator, page_size: int,
                 own: PageAllocator | None = None, window: int | None = None) -> None:
    """Give `req` the whole cached pages of the live request with the longest common prefix.

    Only full pages are shared, and at least one prompt token is left to compute (its logits give
    the first generated token). Pages past the shared ones are the request's own, so no shared page
    is ever written: the KV at a position depends only on the tokens up to it, identical for both.
    With own page lists (`own`; a window of `window` tokens, None: never trimmed) the own-list pages
    the request's first step reads are shared too, so only a request that still holds them may give
    its prefix (one that has given them back is passed over).
    """
    best, n, first = None, 0, 0
    for other in live:
        m = 0
        for a, b in zip(req.prompt, other.tokens[: other.cached]):
            if a != b:
                break
            m += 1
        m = min(m, len(req.prompt) - 1) // page_size  # whole pages
        f = 0 if window is None else max(m * page_size - (window - 1), 0) // page_size  # first page the window sees
        if m > n and (own is None or other.own_first <= f):
            best, n, first = other, m, f
    if not n:
        return
    if own is not None:
        req.own_first, req.own_pages = first, best.own_pages[first - best.own_first : n - best.own_first]
        own.share(req.own_pages)
    req.pages = best.pages[:n]
    pages.share(req.pages)
    req.cached = req.shared = n * page_size


def grow_pages(req: Request, pages: PageAllocator, own: PageAllocator | None, page_size: int) -> None:
    """Pages for every token of `req` (its shared list, and its own list when there is one)."""
    need = -(-len(req.tokens) // page_size)
    req.pages += pages.alloc(need - len(req.pages))
    if own is not None:
        req.own_pages += own.alloc(need - req.own_first - len(req.own_pages))


def drop_passed(req: Request, own: PageAllocator, window: int, page_size: int) -> None:
    """After a step: give back the own-list pages no later step reads (the next query, at position
    req.cached, sees keys from req.cached - window + 1 on)."""
    keep = max(req.cached - (window - 1), 0) // page_size
    if keep > req.own_first:
        own.release(req.own_pages[: keep - req.own_first])
        req.own_pages, req.own_first = req.own_pages[keep - req.own_first :], keep


# ----------------------------------------------------------------------------------------------------
# One step's forward.


def step_inputs(plan: AttentionPlan, tokens: list[int], rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The forward's inputs, one host-to-device copy: ids and positions [rows] int64 on `device`.

    tokens: the step's T new token ids in plan row order. Rows T.. are bucket padding and repeat row
    0: their attention reads one token of page 0 and their K/V write rewrites row 0's slot with row
    0's values, so they change nothing, and a row's values never depend on other rows.
    """
    host = np.array([tokens, plan.positions], dtype=np.int64)  # [2, T]
    host = np.concatenate([host, np.repeat(host[:, :1], rows - plan.num_tokens, axis=1)], axis=1)
    both = torch.from_numpy(host).to(device)
    return {"ids": both[0], "positions": both[1]}


def static_inputs(rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A captured forward's static inputs: ids and positions [rows] int64 zeros on `device` (token 0 at position 0)."""
    return {name: torch.zeros(rows, dtype=torch.int64, device=device) for name in ("ids", "positions")}


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn() and how long it took in µs. On CUDA: CUDA events around it on the current stream, after a
    sync so the GPU starts idle (host launch time shows up as GPU idle time, as in a real step);
    elsewhere the host clock."""
    if device.type != "cuda":
        t0 = time.perf_counter_ns()
        out = fn()
        return out, (time.perf_counter_ns() - t0) / 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) * 1e3


def compiled_forward(forward: Callable[..., torch.Tensor], mode: str) -> Callable[..., torch.Tensor] | None:
    """A model adapter's forward as --compile asks: None ("off"); through torch.compile(fullgraph=True) whole
    ("full"); or split at the attention ops, the pieces between them compiled ("piecewise",
    mstar_attn.piecewise). Compiled, it is called without a step (its layers are the mstar_attn custom ops,
    reading the step of step_context)."""
    if mode == "off":
        return None
    return torch.compile(forward, fullgraph=True) if mode == "full" else piecewise.compile_piecewise(forward)


PIECE_BUCKETS = tuple(1 << i for i in range(3, 11))  # token-count buckets of piecewise graphs: 8 .. 1,024 rows


def piece_bucket(rows: int) -> int | None:
    """The smallest PIECE_BUCKETS size holding `rows` token rows (None past the largest: no graphs)."""
    return next((n for n in PIECE_BUCKETS if n >= rows), None)


def pad_rows(t: torch.Tensor, n: int | None) -> torch.Tensor:
    """t [rows] padded with zeros to n rows (token 0 at position 0: padding rows; t itself when n is None or rows)."""
    if n is None or n == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(n - t.shape[0])])


class Engine:
    """One step's forward through the attention seam: eagerly, or (graphs on) replayed.

    `forward` is the model adapter's (e.g. `llama.forward`): (model, ctx, layers, ids, positions) ->
    logits [R, vocab], the eager path and the function decode graphs capture; layers: the model's
    Attention layers (`attn.layers`).
    With graphs, each step the seam replays (a decode step of a captured bucket) first runs the same
    forward eagerly, on the same committed step and the same padded inputs, then replays its graph;
    both are timed (`timed`) into eager_us / graph_us. The eager run writes the very K/V bytes the
    replay writes again, and the step returns the replay's logits. `aside_us`: host time of the
    last step's eager measurement, which the run keeps out of its step times.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], model, attn: StepAttention, layers: list[Attention],
                 device: torch.device, graphs: bool, compile: str = "off"):
        self.forward, self.model, self.attn, self.layers = forward, model, attn, layers
        self.device, self.graphs = device, graphs
        # compile: see compiled_forward; calls in which torch compiled add to compile_s
        self.compiled = compiled_forward(forward, compile)
        # piecewise with graphs on CUDA: steps padded to a token-count bucket, the pieces replayed per bucket
        self.piece_graphs = compile == "piecewise" and graphs and device.type == "cuda"
        self.compile_s = 0.0
        self.commit_us: list[float] = []
        self.graph_us: list[float] = []
        self.eager_us: list[float] = []
        self.replayed: list[bool] = []  # per step: whether it replayed a graph
        self.aside_us = 0.0
        self.num_graphs, self.capture_s = 0, 0.0

    def fn(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The captured function: inputs "ids", "positions" [R] int64 -> logits [R, vocab]. Compiled: the
        compiled forward inside step_context(ctx); a call in which torch compiled a graph, or a piece captured
        its CUDA graph for a new bucket (piecewise), is timed into compile_s and kept out of the step times
        (aside_us)."""
        if self.compiled is None:
            return self.forward(self.model, ctx, self.layers, inputs["ids"], inputs["positions"])
        graphs = counters["stats"]["unique_graphs"] + piecewise.STATS["captured"]
        t0 = time.perf_counter_ns()
        rows = inputs["ids"].shape[0]
        # (a bucketed decode step, which decode graphs replay whole, captured or being captured, is not padded)
        whole = getattr(ctx, "bucket", None) is not None and ctx.mode is Mode.DECODE
        pad = self.piece_graphs and not whole and not torch.cuda.is_current_stream_capturing()
        n = piece_bucket(rows) if pad else None
        ids, positions = (pad_rows(inputs[name], n) for name in ("ids", "positions"))
        with step_context(ctx, padded_rows=n):
            out = self.compiled(self.model, None, self.layers, ids, positions)[:rows]
        if counters["stats"]["unique_graphs"] + piecewise.STATS["captured"] != graphs:
            spent = (time.perf_counter_ns() - t0) / 1e3
            self.compile_s += spent / 1e6
            self.aside_us += spent
        return out

    def capture(self) -> None:
        """Static inputs for the largest bucket (zeros: token 0 at position 0), then the seam captures."""
        t0 = time.perf_counter()
        self.num_graphs = self.attn.capture(self.fn, static_inputs(self.attn.capture_rows, self.device))
        self.capture_s = time.perf_counter() - t0

    def __call__(self, plan: AttentionPlan, tokens: list[int], before: Callable[[Any], None] | None = None) -> torch.Tensor:
        """Commit and run one step; returns logits [T, vocab] in the model dtype on the device.
        before(ctx): eager work on the committed step ahead of the forward (an encoder storing cross K/V)."""
        t0 = time.perf_counter_ns()
        ctx = self.attn.prepare(plan)
        self.commit_us.append((time.perf_counter_ns() - t0) / 1e3)
        if before is not None:
            before(ctx)
        inputs = step_inputs(plan, tokens, self.attn.token_rows(ctx), self.device)
        self.aside_us = 0.0
        self.replayed.append(bool(self.graphs and self.attn.replays(ctx)))
        if not self.replayed[-1]:
            return self.fn(ctx, inputs)[: plan.num_tokens]
        t1 = time.perf_counter_ns()
        self.eager_us.append(timed(lambda: self.fn(ctx, inputs), self.device)[1])
        self.aside_us = (time.perf_counter_ns() - t1) / 1e3
        logits, us = timed(lambda: self.attn.replay(ctx, inputs), self.device)
        self.graph_us.append(us)
        return logits[: plan.num_tokens]
