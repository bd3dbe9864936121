"""What a run did (DemoResult), its progress bar and its printed summary."""

from __future__ import annotations

from collections import Counter
from typing import TextIO

import attrs
import numpy as np
import torch

from mstar_attn import Mode
from mstar_attn.demo.check import Check
from mstar_attn.demo.config import DemoConfig
from mstar_attn.demo.gpt_oss import EXPERTS, ROUTER_BIAS, SINK_MEAN, SINK_STD


@attrs.define
class PagesHeld:
    """KV pages the live requests hold between steps, for a model whose window layers keep their own
    page list: per request on that list (most_own), and in all on each list (peak_shared: the
    full layers' list, what every layer would hold without own lists; peak_own: the window layers')."""

    window: int
    page_size: int
    most_own: int = 0
    peak_shared: int = 0
    peak_own: int = 0

    @property
    def bound(self) -> int:
        """The most own pages a request can hold between steps: those of its last `window - 1` tokens, plus one."""
        return -(-(self.window - 1) // self.page_size) + 1

    def after_step(self, live, pages, own) -> None:
        self.most_own = max([self.most_own, *(len(r.own_pages) for r in live)])
        self.peak_shared = max(self.peak_shared, pages.held)
        self.peak_own = max(self.peak_own, own.held)


@attrs.define
class DemoResult:
    """What `run_demo` did. Host times in µs, one entry per step: plan_us (build_plan), commit_us
    (prepare: GraphBufferPool.commit on GPU backends), step_us (the whole step, the eager measurement
    left out). graph_us / eager_us: one entry per replayed decode step, timed with CUDA events on
    CUDA (the host clock elsewhere); empty with graphs off."""

    config: DemoConfig
    steps: int
    prompt_tokens: int  # all prompt tokens, shared_tokens of them read from another request's pages
    shared_tokens: int
    prefix_hits: int  # requests that started on shared prefix pages
    generated_tokens: int
    served: dict[str, Counter]  # backend (step.plan.backend) -> Counter of step modes it served
    pages_reused: int  # page allocations of pages an earlier request had freed
    plan_us: list[float]
    step_us: list[float]
    checks: list[Check]
    commit_us: list[float] = attrs.Factory(list)
    graph_us: list[float] = attrs.Factory(list)
    eager_us: list[float] = attrs.Factory(list)
    replayed_steps: list[bool] = attrs.Factory(list)  # per step: whether it replayed a graph
    num_graphs: int = 0  # graphs captured
    capture_s: float = 0.0
    tokens: dict[int, list[int]] = attrs.Factory(dict)  # request id -> prompt + generated tokens
    pages_held: PagesHeld | None = None  # with window layers on their own page lists (gemma2)
    encoder_tokens: int = 0  # an encoder-decoder's encoder inputs, all requests (bart)
    cross_rows: bool = False  # its cross page lists came from the pool's cross table (CrossRows)
    cascade_steps: int = 0  # steps that read shared prompts once per prefix group (AttentionSpec.cascade)
    compile_s: float = 0.0  # --compile: seconds of the steps in which torch compiled (kept out of step_us)
    graph_breaks: int = 0  # --compile: torch._dynamo's graph-break count over the run
    piece_graphs: int = 0  # --compile piecewise with --graphs on CUDA: piece graphs captured (mstar_attn.piecewise)
    piece_replays: int = 0  # ... and replayed

    @property
    def modes(self) -> Counter:
        return sum(self.served.values(), Counter())

    @property
    def replayed(self) -> int:
        return len(self.graph_us)

    @property
    def speedup(self) -> float:
        """Median eager decode step time over median replayed one (nan without graphs)."""
        return float(np.median(self.eager_us) / np.median(self.graph_us)) if self.graph_us else float("nan")

    @property
    def max_logit_err(self) -> float:
        return max(c.err for c in self.checks)

    @property
    def tokens_match(self) -> bool:
        return all(c.token_mismatches == 0 for c in self.checks)

    @property
    def matched(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def tokens_per_s(self) -> float:
        """Tokens the timed steps processed, per second: prompt tokens not read from shared pages, an
        encoder-decoder's encoder inputs (each step that admits a request runs its encoder), generated tokens."""
        done = self.prompt_tokens - self.shared_tokens + self.encoder_tokens + self.generated_tokens
        return done / (sum(self.step_us) * 1e-6)


class Progress:
    """A plain-text progress bar over finished requests, redrawn in place on a terminal (stderr in the CLI)."""

    def __init__(self, out: TextIO | None, total: int, width: int = 30):
        self.out, self.total, self.width = out, total, width
        self.tty = out is not None and out.isatty()

    def line(self, done: int, step: int) -> str:
        fill = self.width * done // self.total
        return f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} requests, step {step}"

    def note(self, text: str) -> None:
        if self.out is not None:
            self.out.write(text + "\n")
            self.out.flush()

    def update(self, done: int, step: int) -> None:
        if self.tty:
            self.out.write("\r" + self.line(done, step))
            self.out.flush()

    def close(self, done: int, step: int) -> None:
        if self.out is not None:
            self.out.write(("\r" if self.tty else "") + self.line(done, step) + "\n")
            self.out.flush()


def write(out: TextIO, text: str) -> None:
    """Write text, spelling µ as u where the stream's encoding has no µ."""
    try:
        out.write(text)
    except UnicodeEncodeError:
        out.write(text.replace("µ", "u"))


def summary(res: DemoResult) -> str:
    """The printed report, a line each: model, trace, speed, decode step times (graphs only), what
    served which steps, the oracle's errors and the verdict `matches transformers: yes|no (...)`."""
    c = res.config
    us = lambda xs: f"median {np.median(xs):.0f}, mean {np.mean(xs):.0f}"  # noqa: E731
    served = "; ".join(f"{b}: " + ", ".join(f"{m} {n}" for m, n in sorted(cnt.items())) for b, cnt in res.served.items())
    worst = max(res.checks, key=lambda k: k.err / k.tol)
    checked = sum(k.tokens_checked for k in res.checks)
    mismatches = sum(k.token_mismatches for k in res.checks)
    bad = [k.rid for k in res.checks if not k.ok]
    host = [p + q for p, q in zip(res.plan_us, res.commit_us)]
    clock = "CUDA events" if torch.device(c.device).type == "cuda" else "host clock"
    family = {"llama": "Llama", "gemma2": f"Gemma 2 (sliding window {c.window} / full layers, soft-capped)",
              "bart": "BART encoder-decoder (encoder through the dense path, cross attention on paged encoder K/V)",
              "gpt_oss": f"gpt-oss (attention sinks drawn N({SINK_MEAN:g}, {SINK_STD:g}^2) per head, sliding window {c.window} "
                         f"/ full layers, {EXPERTS} experts, router bias {ROUTER_BIAS}: no token near a routing tie)"}[c.model]
    lines = [
        f"model     {family} {c.layers} layers, hidden {c.hidden}, {c.heads} q / {c.heads if c.model == 'bart' else c.kv_heads} "
        f"kv heads, vocab {c.vocab}, "
        f"{c.dtype} on {c.device}, page size {c.page_size}",
        f"trace     {c.requests} requests, {res.steps} steps, {res.prompt_tokens} prompt tokens "
        f"({res.shared_tokens} read from shared prefix pages by {res.prefix_hits} requests) "
        f"+ {res.generated_tokens} generated, {res.pages_reused} page allocations reused freed pages",
        f"speed     {res.tokens_per_s:.0f} tokens/s{' (encoder inputs counted)' if res.encoder_tokens else ''}; host µs per step: build_plan + commit median {np.median(host):.0f} "
        f"(build_plan {us(res.plan_us)}; commit {us(res.commit_us)}); whole step {us(res.step_us)}",
    ]
    if res.graph_us:
        replayed = [h for h, r in zip(host, res.replayed_steps) if r]
        lines.append(
            f"decode step: graphs {np.median(res.graph_us):.0f} µs vs eager {np.median(res.eager_us):.0f} µs "
            f"({res.speedup:.2f}x; {clock}, median over {res.replayed} decode steps, each run both ways on the same "
            f"inputs; {res.num_graphs} graphs captured in {res.capture_s:.1f} s); host µs of those steps: "
            f"build_plan + commit median {np.median(replayed):.0f}")
    if c.compile != "off":
        lines.append(
            f"compile   torch.compile(fullgraph=True) of the {'decoder ' if c.model == 'bart' else ''}step's forward, "
            f"attention as mstar_attn custom ops{': piecewise, split at attention' if c.compile == 'piecewise' else ''}: "
            f"graph breaks: {res.graph_breaks}; {res.compile_s:.1f} s compiling "
            "(those steps, and those in which a piece captured a graph, left out of the step times)"
            + (f"; pieces between attention calls: {res.piece_graphs} CUDA graphs captured per token-count bucket, "
               f"{res.piece_replays} replays" if res.piece_graphs else ""))
    if res.encoder_tokens:
        lines.append(
            f"encoder   {res.encoder_tokens} encoder tokens run once through the dense path; each request's cross K/V "
            "stored at its first step, read by every later step; cross page lists "
            + ("gathered on the device from the pool's cross table (no page ids copied per step)" if res.cross_rows
               else "listed by each step"))
    if res.pages_held is not None:
        p = res.pages_held
        lines.append(
            f"pages     window layers on their own page lists: at most {p.most_own} pages per request between steps "
            f"(bound (window - 1) / page size + 1 = {p.bound}); peak held: full layers {p.peak_shared}, window layers "
            f"{p.peak_own} (without per-group lists: {p.peak_shared})")
    graphs = f"; CUDA graphs replayed {res.replayed} of {res.modes[Mode.DECODE.value]} decode steps" if c.graphs else ""
    if c.cascade != "off":
        graphs += (f"; shared prompts read once per prefix group (cascade {c.cascade}) in {res.cascade_steps} "
                   f"of {res.steps} steps")
    lines += [
        f"served    {served}{graphs}",
        f"oracle    max |logit diff| {res.max_logit_err:.2e}; closest to its tolerance: request {worst.rid}, "
        f"{worst.err:.2e} vs {worst.tol:.2e}; greedy tokens agreeing {checked - mismatches}/{checked}"
        + ("" if checked == res.generated_tokens else f" (of {res.generated_tokens}: each request stops at its first near-tie)"),
        f"matches transformers: {'yes' if res.matched else 'no (requests ' + ', '.join(map(str, bad)) + ')'}",
    ]
    return "\n".join(lines) + "\n"
