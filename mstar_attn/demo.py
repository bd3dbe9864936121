"""End-to-end demo: a small random Llama from `transformers`, served through mstar_attn, checked against it.

The engine here is a toy (one process, greedy sampling, whole-prompt prefill) but its attention is the
real thing: every layer of every step goes build_plan -> prepare -> write_kv -> run over a paged KV
cache, with requests arriving mid-flight (MIXED steps), sharing prompt-prefix pages, finishing at
different lengths and handing their pages to newcomers. On a GPU backend with graphs on (the CUDA
default) the whole decode forward (embedding, every layer's write_kv + run and the rest of the layer
math, lm_head) is captured once per (pool slot, bucket) and each decode step replays one CUDA graph;
prefill, mixed and extend steps run eagerly. At the end the stock HF model (eager attention, no cache,
full sequences) recomputes every logit the engine computed.

    python -m mstar_attn demo [--backend reference] [--graphs] [--layers 4] [--hidden 256] [--requests 8] ...
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Callable, TextIO

import attrs
import numpy as np
import torch

from mstar_attn import AttentionPlan, AttentionSpec, BACKENDS, Mode, PagedKVCache, StepBatch, build_plan, kernels
from mstar_attn.kernels import ALL_MODES, AUTO

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Logit tolerance |engine - oracle| <= REL * max|oracle logit| + ABS, per request. Both sides run the
# same weights on the same tokens; they differ only in summation order (the reference backend does
# one einsum per request in float32, HF eager one batched matmul with an additive mask; the linear
# layers see T step rows here, N sequence rows there). float32: each op is off by ~sqrt(K)*2^-24,
# and the logits end up ~1e-6 relative apart (measured: <= 1.3e-6 over seeds 0-4, 4 and 8 layers),
# so 1e-3 leaves ~800x headroom while a wrong attention (wrong key, position or row) moves logits
# by percents of their scale (scaling every attention output by 0.98 already fails it ~20x over).
# bf16/fp16: both sides round every op's output to the dtype (eps 2^-8 resp. 2^-11) at different
# points (the reference attends in float32, eager rounds the softmax probabilities to the dtype),
# and the roundings compound through the residual stream: measured <= 2.3e-2 (bf16, ~6 eps) and
# <= 2.9e-3 (fp16, ~6 eps) relative; the bounds below leave ~2-3x over that for other backends.
REL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
ABS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
GPU_HIDDEN = 512  # default hidden size on GPU backends: 8 heads of 64 dims (FlashInfer serves 64, 128, 256)


class DemoError(RuntimeError):
    """A demo setting that cannot run here (no CUDA, no transformers, unknown backend...)."""


@attrs.frozen
class DemoConfig:
    """Model size, trace and where to run. None: this machine's default (see `resolve`)."""

    backend: str | None = None  # None: "flashinfer" with CUDA, else "reference"; "auto": the plan picks per step
    graphs: bool | None = None  # replay decode steps as CUDA graphs; None: on for GPU backends
    device: str | None = None  # None: "cuda" when available, else "cpu"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on the CPU
    layers: int = 4
    hidden: int | None = None  # None: 512 on GPU backends (head dim 64), else 256 (head dim 32)
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 512
    init_std: float = 0.05  # weight init std: above HF's 0.02 so attention is not near uniform
    requests: int = 8
    seed: int = 0
    page_size: int = 4

    @property
    def gpu(self) -> bool:
        """A GPU backend (every backend but the reference one), once resolved."""
        return self.backend != "reference"

    def resolve(self) -> DemoConfig:
        cuda = torch.cuda.is_available()
        backend = self.backend or ("flashinfer" if cuda else "reference")
        gpu = backend != "reference"
        return attrs.evolve(
            self,
            backend=backend,
            graphs=gpu if self.graphs is None else self.graphs,
            device=self.device or ("cuda" if cuda else "cpu"),
            dtype=self.dtype or ("bfloat16" if cuda else "float32"),
            hidden=(GPU_HIDDEN if gpu else 256) if self.hidden is None else self.hidden,
        )


# ----------------------------------------------------------------------------------------------------
# The backend seam: the engine's only attention call sites. GPU backends swap this class.


class StepAttention:
    """Attention through the backend each step's plan names (`kernels.write_kv` / `kernels.run`
    dispatch on plan.backend): `bind(spec, ...)` once, `ctx = prepare(plan)` per step, then per layer
    `write_kv(ctx, k, v, cache)` and `run(ctx, q, cache, group=g, k=k, v=v)`.

    Here ctx is the plan itself and everything runs eagerly on the host's order. PoolAttention (GPU)
    commits plans into device buffers and can capture the decode forward as CUDA graphs: `capture`,
    `replays`, `replay` are its graph half, which this class does not have.
    """

    def __init__(self, name: str):
        self.name = name
        self.spec: AttentionSpec | None = None
        self.max_batch = 0

    def bind(self, spec: AttentionSpec, max_batch: int, max_tokens: int) -> None:
        """Called once before the first step: the model's spec and the most requests / tokens a step has."""
        self.spec, self.max_batch = spec, max_batch

    def prepare(self, plan: AttentionPlan):
        return plan

    def rows(self, ctx) -> int:
        """Token rows the forward feeds this step: q, k, v and every activation are [rows, ...]."""
        return ctx.num_tokens

    def write_kv(self, ctx, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache) -> None:
        kernels.write_kv(ctx, k, v, cache)

    def run(self, ctx, q: torch.Tensor, cache: PagedKVCache, group: int, k=None, v=None) -> torch.Tensor:
        return kernels.run(ctx, q, cache, group, k, v)

    @property
    def capture_rows(self) -> int:
        """Rows of the static input buffers `capture` needs (its largest captured batch)."""
        return self.max_batch

    def capture(self, fn: Callable[[Any, dict], torch.Tensor], static: dict[str, torch.Tensor]) -> int:
        """Record fn(ctx, inputs) for every decode shape served later; returns the number of graphs."""
        raise DemoError(f"--graphs needs a GPU backend (backend {self.name!r} runs eagerly); use --no-graphs")

    def replays(self, ctx) -> bool:
        """Whether `replay` serves this step from a captured graph."""
        return False

    def replay(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise DemoError(f"backend {self.name!r} has no captured graphs")


class PoolAttention(StepAttention):
    """A GPU backend: prepare commits the plan into a GraphBufferPool; capture records the decode
    forward per (pool slot, bucket) with DecodeGraphs, and replay runs the graph of a committed step.

    The pool's buckets are the powers of two up to the trace's largest batch, so every decode step
    of the demo has a graph (with backend "auto", see `replays`). A captured graph reads only what
    commit refreshes in place (the slot's device buffers, the backend state planned for that slot
    and bucket), the static inputs it was captured on, the weights and the KV caches.
    """

    def __init__(self, name: str, device: str | torch.device = "cuda"):
        super().__init__(name)
        self.device = torch.device(device)
        self.pool = self.graphs = None

    def bind(self, spec: AttentionSpec, max_batch: int, max_tokens: int) -> None:
        super().bind(spec, max_batch, max_tokens)
        try:
            from mstar_attn.capture.pool import GraphBufferPool

            self.pool = GraphBufferPool(spec, max_batch_size=max_batch, max_num_tokens=max_tokens,
                                        max_num_pages=spec.num_pages, device=self.device)
        except ImportError as e:
            raise DemoError(f"backend {self.name!r} cannot load here: {e}") from e

    def prepare(self, plan: AttentionPlan):
        return self.pool.commit(plan)

    def rows(self, ctx) -> int:
        return ctx.num_rows  # decode: the bucket (padded); other modes: the step's tokens

    @property
    def capture_rows(self) -> int:
        return max(self.pool.buckets)

    def capture(self, fn: Callable[[Any, dict], torch.Tensor], static: dict[str, torch.Tensor]) -> int:
        from mstar_attn.capture.graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.pool, fn, static)
        self.graphs.capture()  # per bucket and slot; with --backend auto, per paged backend too
        return len(self.graphs.graphs)

    def replays(self, ctx) -> bool:
        """A decode step with a graph captured for its bucket, slot and backend (see DecodeGraphs.serves)."""
        return ctx.mode is Mode.DECODE and self.graphs.serves(ctx)

    def replay(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.graphs(ctx, **inputs)


def make_attention(cfg: DemoConfig) -> StepAttention:
    """The attention seam for a resolved config; raises DemoError with the reason when it cannot run."""
    if cfg.backend != AUTO and cfg.backend not in BACKENDS:
        raise DemoError(f"unknown backend {cfg.backend!r} (known: {', '.join(sorted(BACKENDS))}, {AUTO})")
    if cfg.backend != AUTO and BACKENDS[cfg.backend].modes != ALL_MODES:
        raise DemoError(f"backend {cfg.backend!r} serves only {', '.join(sorted(BACKENDS[cfg.backend].modes))} steps "
                        f"and the demo's trace has decode and mixed steps; use --backend {AUTO} to let each plan pick")
    if cfg.gpu and not torch.cuda.is_available():
        raise DemoError(f"backend {cfg.backend!r} needs a CUDA device and none is visible; use --backend reference")
    if cfg.gpu and torch.device(cfg.device).type != "cuda":
        raise DemoError(f"backend {cfg.backend!r} runs on CUDA, not on --device {cfg.device}")
    if cfg.graphs and not cfg.gpu:
        raise DemoError("--graphs needs a GPU backend (the reference backend runs eagerly); use --no-graphs")
    return PoolAttention(cfg.backend, cfg.device) if cfg.gpu else StepAttention(cfg.backend)


# ----------------------------------------------------------------------------------------------------
# Pages and requests.


class PageAllocator:
    """LIFO free list of page ids with reference counts (a shared prefix page is held by several
    requests). `reused` counts allocations of pages some earlier request had already used."""

    def __init__(self, num_pages: int):
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


def share_prefix(req: Request, live: list[Request], pages: PageAllocator, page_size: int) -> None:
    """Give `req` the whole cached pages of the live request with the longest common prefix.

    Only full pages are shared, and at least one prompt token is left to compute (its logits give
    the first generated token). Pages past the shared ones are the request's own, so no shared page
    is ever written: the KV at a position depends only on the tokens up to it, identical for both.
    """
    best, n = None, 0
    for other in live:
        m = 0
        for a, b in zip(req.prompt, other.tokens[: other.cached]):
            if a != b:
                break
            m += 1
        if m > n:
            best, n = other, m
    n = min(n, len(req.prompt) - 1) // page_size
    if n:
        req.pages = best.pages[:n]
        pages.share(req.pages)
        req.cached = req.shared = n * page_size


# ----------------------------------------------------------------------------------------------------
# The model: HF weights and modules, attention through mstar_attn.


def build_model(cfg: DemoConfig, dtype: torch.dtype, device: torch.device):
    """A random LlamaForCausalLM (eager attention, so it is the plain-math oracle), seeded, nothing downloaded."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise DemoError("the demo needs transformers: pip install 'mstar_attn[demo]'") from e
    if cfg.hidden % (2 * cfg.heads):
        raise DemoError(f"--hidden {cfg.hidden} must be a multiple of 2 x {cfg.heads} query heads (RoPE needs even head dims)")
    hf = LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, max_position_embeddings=1024, initializer_range=cfg.init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(hf)
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()


def forward(model, attn: StepAttention, ctx, caches: list[PagedKVCache], ids: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    """One engine step through the HF modules: the eager path, and the function decode graphs capture.

    ids, positions: [R] int64 on the model's device, R = attn.rows(ctx): the step's new tokens in plan
    row order, then bucket padding. Returns logits [R, vocab] in the model dtype. Launches kernels only:
    everything it reads is on the device (ctx's committed buffers, weights, caches, these inputs), and
    no host value in it changes between steps of one (slot, bucket), so it is graph-safe.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, spec, R = model.model, attn.spec, ids.shape[0]
    h = m.embed_tokens(ids)  # [R, hidden]
    cos, sin = (t[0] for t in m.rotary_emb(h[None], positions[None]))  # [R, head_dim]; HF wants a batch dim
    heads = lambda x: x.view(R, -1, spec.head_dim)  # noqa: E731  [R, H * D] -> [R, H, D]
    for i, layer in enumerate(m.layers):
        sa, x = layer.self_attn, layer.input_layernorm(h)
        q, k = apply_rotary_pos_emb(heads(sa.q_proj(x)), heads(sa.k_proj(x)), cos, sin, unsqueeze_dim=1)
        v = heads(sa.v_proj(x))
        attn.write_kv(ctx, k, v, caches[i])
        h = h + sa.o_proj(attn.run(ctx, q, caches[i], group=spec.layer_groups[i], k=k, v=v).reshape(R, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))


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


class Engine:
    """One step's forward through the attention seam: eagerly, or (graphs on) replayed.

    With graphs, each step the seam replays (a decode step of a captured bucket) first runs the same
    forward eagerly, on the same committed step and the same padded inputs, then replays its graph;
    both are timed (`timed`) into eager_us / graph_us. The eager run writes the very K/V bytes the
    replay writes again, and the step returns the replay's logits. `aside_us`: host time of the
    last step's eager measurement, which the run keeps out of its step times.
    """

    def __init__(self, model, attn: StepAttention, caches: list[PagedKVCache], device: torch.device, graphs: bool):
        self.model, self.attn, self.caches, self.device, self.graphs = model, attn, caches, device, graphs
        self.commit_us: list[float] = []
        self.graph_us: list[float] = []
        self.eager_us: list[float] = []
        self.aside_us = 0.0
        self.num_graphs, self.capture_s = 0, 0.0

    def fn(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The captured function: inputs "ids", "positions" [R] int64 -> logits [R, vocab]."""
        return forward(self.model, self.attn, ctx, self.caches, inputs["ids"], inputs["positions"])

    def capture(self) -> None:
        """Static inputs for the largest bucket (zeros: token 0 at position 0), then the seam captures."""
        t0 = time.perf_counter()
        rows = self.attn.capture_rows
        static = {name: torch.zeros(rows, dtype=torch.int64, device=self.device) for name in ("ids", "positions")}
        self.num_graphs = self.attn.capture(self.fn, static)
        self.capture_s = time.perf_counter() - t0

    def __call__(self, plan: AttentionPlan, tokens: list[int]) -> torch.Tensor:
        """Commit and run one step; returns logits [T, vocab] in the model dtype on the device."""
        t0 = time.perf_counter_ns()
        ctx = self.attn.prepare(plan)
        self.commit_us.append((time.perf_counter_ns() - t0) / 1e3)
        inputs = step_inputs(plan, tokens, self.attn.rows(ctx), self.device)
        self.aside_us = 0.0
        if not (self.graphs and self.attn.replays(ctx)):
            return self.fn(ctx, inputs)[: plan.num_tokens]
        t1 = time.perf_counter_ns()
        self.eager_us.append(timed(lambda: self.fn(ctx, inputs), self.device)[1])
        self.aside_us = (time.perf_counter_ns() - t1) / 1e3
        logits, us = timed(lambda: self.attn.replay(ctx, inputs), self.device)
        self.graph_us.append(us)
        return logits[: plan.num_tokens]


# ----------------------------------------------------------------------------------------------------
# The check against transformers.


@attrs.frozen
class Check:
    """One request against the oracle. err: max |logit diff|; tol: its bound; tokens_checked: greedy
    tokens compared (bf16/fp16 stop at the oracle's first near-tie); token_mismatches among them."""

    rid: int
    err: float
    tol: float
    tokens_checked: int
    token_mismatches: int

    @property
    def ok(self) -> bool:
        return self.err <= self.tol and self.token_mismatches == 0


def check_request(model, req: Request, dtype: torch.dtype) -> Check:
    """Teacher-forced: the stock model on prompt + generated tokens, at every position the engine computed."""
    ids = torch.tensor([req.tokens[:-1]], device=model.device)
    want = model(ids).logits[0, req.shared :].float().cpu()  # [n, vocab]
    got = torch.cat(req.logits)
    tol = REL[dtype] * want.abs().max().item() + ABS[dtype]
    err = (got - want).abs().max().item()
    gen = want[len(req.prompt) - 1 - req.shared :]  # rows whose argmax is a generated token
    top2 = gen.topk(2, dim=-1).values
    checked = mismatches = 0
    for row, tok, (a, b) in zip(gen, req.tokens[len(req.prompt) :], top2.tolist()):
        if dtype != torch.float32 and a - b < tol:
            break  # a near-tie: either token is right within the dtype's precision
        checked += 1
        mismatches += int(row.argmax().item() != tok)
    return Check(req.rid, err, tol, checked, mismatches)


# ----------------------------------------------------------------------------------------------------
# The run.


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
    num_graphs: int = 0  # graphs captured
    capture_s: float = 0.0
    tokens: dict[int, list[int]] = attrs.Factory(dict)  # request id -> prompt + generated tokens

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
        return (self.prompt_tokens - self.shared_tokens + self.generated_tokens) / (sum(self.step_us) * 1e-6)


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


def run_demo(cfg: DemoConfig = DemoConfig(), *, attention: StepAttention | None = None, out: TextIO | None = None,
             progress: TextIO | None = None) -> DemoResult:
    """Serve the trace, check it against transformers, print a summary to `out` (None: silent) and the
    progress bar to `progress` (None: none).

    `attention` overrides the backend seam (tests pass a broken one to see the check fail).
    """
    cfg = cfg.resolve()
    if cfg.dtype not in DTYPES:
        raise DemoError(f"unknown dtype {cfg.dtype!r} (known: {', '.join(DTYPES)})")
    if min(cfg.requests, cfg.layers, cfg.page_size, cfg.hidden) < 1:
        raise DemoError("--requests, --layers, --hidden and --page-size must be >= 1")
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    attn = attention or make_attention(cfg)
    rng = np.random.default_rng(cfg.seed)
    reqs = make_trace(cfg, rng)
    ps = cfg.page_size
    num_pages = sum(-(-(len(r.prompt) + r.max_new) // ps) for r in reqs)  # enough with no sharing at all
    spec = AttentionSpec(cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads, ps, num_pages, dtype=dtype,
                         layer_groups=(0,) * cfg.layers, backend=attn.name)
    bar = Progress(progress, len(reqs))
    with torch.inference_mode():
        model = build_model(cfg, dtype, device)
        caches = [PagedKVCache.allocate(spec, device) for _ in range(cfg.layers)]
        for c in caches:
            c.k.zero_(), c.v.zero_()
        # the largest batch, as a power of two (the decode buckets), and the most tokens one step can have
        attn.bind(spec, 1 << (cfg.requests - 1).bit_length(), sum(len(r.prompt) for r in reqs) + len(reqs))
        engine = Engine(model, attn, caches, device, cfg.graphs)
        if cfg.graphs:
            bar.note("capturing the decode forward as CUDA graphs ...")
            engine.capture()  # before any request: capture's warm-up writes to page 0, which no one holds yet
            bar.note(f"captured {engine.num_graphs} graphs in {engine.capture_s:.1f} s")
        pages = PageAllocator(num_pages)
        served: dict[str, Counter] = {}
        plan_us, step_us = [], []
        waiting, running, finished = deque(reqs), [], []
        step = 0
        while waiting or running:
            if not running and waiting[0].arrival > step:
                step = waiting[0].arrival  # idle: skip ahead to the next arrival
            t0 = time.perf_counter_ns()
            new = []
            while waiting and waiting[0].arrival <= step:
                new.append(waiting.popleft())
                share_prefix(new[-1], running, pages, ps)
            batch = [(running + new)[i] for i in rng.permutation(len(running) + len(new))]  # order is free
            for r in batch:
                r.pages += pages.alloc(-(-len(r.tokens) // ps) - len(r.pages))
            step_batch = StepBatch.from_pages([len(r.tokens) - r.cached for r in batch], [len(r.tokens) for r in batch],
                                              [r.pages for r in batch], ps)
            t1 = time.perf_counter_ns()
            plan = build_plan(step_batch, spec)
            t2 = time.perf_counter_ns()
            logits = engine(plan, [t for r in batch for t in r.tokens[r.cached :]]).float()
            last = logits[torch.from_numpy(plan.qo_indptr[1:] - 1).to(device).long()].argmax(-1).tolist()
            rows = logits.cpu()
            for i, (r, tok) in enumerate(zip(batch, last)):
                r.logits.append(rows[plan.qo_indptr[i] : plan.qo_indptr[i + 1]])
                r.cached = len(r.tokens)
                r.tokens.append(tok)
                if r.done:
                    pages.release(r.pages)
                    finished.append(r)
            running = [r for r in batch if not r.done]
            served.setdefault(plan.backend, Counter())[plan.mode.value] += 1
            plan_us.append((t2 - t1) / 1e3)
            step_us.append((time.perf_counter_ns() - t0) / 1e3 - engine.aside_us)
            step += 1
            bar.update(len(finished), step)
        bar.close(len(finished), step)
        checks = [check_request(model, r, dtype) for r in sorted(finished, key=lambda r: r.rid)]
    result = DemoResult(
        cfg, len(step_us), sum(len(r.prompt) for r in reqs), sum(r.shared for r in reqs),
        sum(r.shared > 0 for r in reqs), sum(r.max_new for r in reqs), served, pages.reused, plan_us, step_us, checks,
        engine.commit_us, engine.graph_us, engine.eager_us, engine.num_graphs, engine.capture_s,
        {r.rid: r.tokens for r in reqs},
    )
    if out is not None:
        write(out, summary(result))
    return result


def write(out: TextIO, text: str) -> None:
    """Write text, spelling µ as u where the stream's encoding has no µ."""
    try:
        out.write(text)
    except UnicodeEncodeError:
        out.write(text.replace("µ", "u"))


def summary(res: DemoResult) -> str:
    c = res.config
    us = lambda xs: f"median {np.median(xs):.0f}, mean {np.mean(xs):.0f}"  # noqa: E731
    served = "; ".join(f"{b}: " + ", ".join(f"{m} {n}" for m, n in sorted(cnt.items())) for b, cnt in res.served.items())
    worst = max(res.checks, key=lambda k: k.err / k.tol)
    checked = sum(k.tokens_checked for k in res.checks)
    mismatches = sum(k.token_mismatches for k in res.checks)
    bad = [k.rid for k in res.checks if not k.ok]
    host = [p + q for p, q in zip(res.plan_us, res.commit_us)]
    clock = "CUDA events" if torch.device(c.device).type == "cuda" else "host clock"
    lines = [
        f"model     Llama {c.layers} layers, hidden {c.hidden}, {c.heads} q / {c.kv_heads} kv heads, vocab {c.vocab}, "
        f"{c.dtype} on {c.device}, page size {c.page_size}",
        f"trace     {c.requests} requests, {res.steps} steps, {res.prompt_tokens} prompt tokens "
        f"({res.shared_tokens} read from shared prefix pages by {res.prefix_hits} requests) "
        f"+ {res.generated_tokens} generated, {res.pages_reused} page allocations reused freed pages",
        f"speed     {res.tokens_per_s:.0f} tokens/s; host µs per step: build_plan + commit median {np.median(host):.0f} "
        f"(build_plan {us(res.plan_us)}; commit {us(res.commit_us)}); whole step {us(res.step_us)}",
    ]
    if res.graph_us:
        lines.append(
            f"decode step: graphs {np.median(res.graph_us):.0f} µs vs eager {np.median(res.eager_us):.0f} µs "
            f"({res.speedup:.2f}x; {clock}, median over {res.replayed} decode steps, each run both ways on the same "
            f"inputs; {res.num_graphs} graphs captured in {res.capture_s:.1f} s)")
    graphs = f"; CUDA graphs replayed {res.replayed} of {res.modes[Mode.DECODE.value]} decode steps" if c.graphs else ""
    lines += [
        f"served    {served}{graphs}",
        f"oracle    max |logit diff| {res.max_logit_err:.2e}; closest to its tolerance: request {worst.rid}, "
        f"{worst.err:.2e} vs {worst.tol:.2e}; greedy tokens agreeing {checked - mismatches}/{checked}"
        + ("" if checked == res.generated_tokens else f" (of {res.generated_tokens}: each request stops at its first near-tie)"),
        f"matches transformers: {'yes' if res.matched else 'no (requests ' + ', '.join(map(str, bad)) + ')'}",
    ]
    return "\n".join(lines) + "\n"
