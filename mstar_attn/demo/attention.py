"""The attention seam: the engine's only attention call sites. GPU backends swap the class.

The model's layers are `mstar_attn.Attention` objects (`layers`: one per model layer, over its cache), whose
`forward(q, k, v, step)` stores and attends; the seam is the engine's side of a step. StepAttention hands
each step's plan to the layers as it is (the reference backend runs it eagerly); PoolAttention commits
plans into a GraphBufferPool and captures / replays the decode forward as CUDA graphs; `make_attention`
picks one for a resolved DemoConfig or says why it cannot.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mstar_attn import Attention, AttentionPlan, AttentionSpec, BACKENDS, Mode, PagedKVCache
from mstar_attn.demo.config import DemoConfig, DemoError
from mstar_attn.kernels import ALL_MODES, AUTO
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN


class StepAttention:
    """The engine's side of a step: `bind(spec, ...)` once, `layers(spec, caches)` for the model's
    Attention layers, `ctx = prepare(plan)` per step, then each layer's `forward(q, k, v, ctx)` (the backend
    the plan names: `kernels.run` dispatches on plan.backend).

    Here ctx is the plan itself and everything runs eagerly on the host's order. PoolAttention (GPU)
    commits plans into device buffers and can capture the decode forward as CUDA graphs: `capture`,
    `replays`, `replay` are its graph half, which this class does not have.
    """

    def __init__(self, name: str):
        self.name = name
        self.spec: AttentionSpec | None = None
        self.max_batch = 0

    def bind(self, spec: AttentionSpec, max_batch: int, max_tokens: int, max_encoder_tokens: int | None = None) -> None:
        """Called once before the first step: the model's spec, the most requests / tokens a step has,
        and (an encoder-decoder) the most encoder tokens one step stores."""
        self.spec, self.max_batch = spec, max_batch

    @property
    def cross_table(self):
        """The pool's cross table (encoder pages by request row), or None: steps list the pages."""
        return None

    def prepare(self, plan: AttentionPlan):
        return plan

    def token_rows(self, ctx) -> int:
        """Token rows the forward feeds this step: q, k, v and every activation are [rows, ...]."""
        return ctx.num_tokens

    layer_class = Attention  # the class of the model's layers (a subclass counts calls or injects faults in tests)

    def layers(self, spec: AttentionSpec, caches: list[PagedKVCache], sinks=None) -> list[Attention]:
        """One `layer_class` per model layer, over caches[layer] (tagged with the layer's group), with
        sinks[layer] (float32 [heads]) where the model has attention sinks (None: none)."""
        if sinks is None:
            return [self.layer_class(spec, i, cache) for i, cache in enumerate(caches)]
        if len(sinks) != len(caches):
            raise DemoError(f"sinks: {len(sinks)} entries for {len(caches)} layers")
        return [self.layer_class(spec, i, cache, sinks=s) for i, (cache, s) in enumerate(zip(caches, sinks))]

    @property
    def capture_rows(self) -> int:
        """Rows of the static input buffers `capture` needs (its largest captured batch)."""
        return self.max_batch

    def capture(self, fn: Callable[[Any, dict], torch.Tensor], static: dict[str, torch.Tensor], q_len: int = 1,
                trees: bool = False) -> int:
        """Record fn(ctx, inputs) for every decode shape served later (q_len > 1: verify steps of q_len tokens,
        with `trees` token-tree verify steps too); returns the number of graphs."""
        raise DemoError(f"--graphs needs a GPU backend (backend {self.name!r} runs eagerly); use --no-graphs")

    def replays(self, ctx) -> bool:
        """Whether `replay` serves this step from a captured graph."""
        return False

    def replay(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise DemoError(f"backend {self.name!r} has no captured graphs")

    def prepare_round(self, draft) -> tuple:
        """The K steps of a draft round (metadata/draft.py): here its plans, run eagerly."""
        return draft.steps

    def round_rows(self, steps) -> int:
        return steps[0].batch_size

    def run_round(self, fn: Callable[[tuple, dict], torch.Tensor], steps, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """fn(steps, inputs): eagerly here; PoolAttention replays a captured round graph."""
        return fn(steps, inputs)


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

    def bind(self, spec: AttentionSpec, max_batch: int, max_tokens: int, max_encoder_tokens: int | None = None,
             max_draft_steps: int = 1, max_tree_nodes: int = MAX_VERIFY_Q_LEN) -> None:
        super().bind(spec, max_batch, max_tokens)
        try:
            from mstar_attn.capture.pool import GraphBufferPool
            from mstar_attn.capture.limits import PoolLimits

            cross = spec.has_cross  # an encoder-decoder: encoder pages in the pool's cross table
            self.pool = GraphBufferPool(spec, PoolLimits(max_batch_size=max_batch, max_num_tokens=max_tokens,
                                                         max_num_pages=spec.num_pages,
                                                         max_requests=4 * max_batch if cross else None,
                                                         max_encoder_tokens=max_encoder_tokens if cross else None,
                                                         max_draft_steps=max_draft_steps, max_tree_nodes=max_tree_nodes),
                                      device=self.device)
        except ImportError as e:
            raise DemoError(f"backend {self.name!r} cannot load here: {e}") from e

    @property
    def cross_table(self):
        return self.pool.cross_table

    def prepare(self, plan: AttentionPlan):
        return self.pool.commit(plan, defer=True)  # (a StepRows decode step: its device work runs in the graph)

    def token_rows(self, ctx) -> int:
        return ctx.padded_num_tokens  # decode: the bucket (padded); other modes: the step's tokens

    @property
    def capture_rows(self) -> int:
        return max(self.pool.buckets)

    def capture(self, fn: Callable[[Any, dict], torch.Tensor], static: dict[str, torch.Tensor], q_len: int = 1,
                trees: bool = False) -> int:
        from mstar_attn.capture.graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.pool, fn, static)
        self.graphs.capture(q_lens=(q_len,), trees=trees)  # per bucket and slot; with --backend auto, per paged backend too
        return len(self.graphs.graphs)

    def replays(self, ctx) -> bool:
        """A decode or verify step with a graph captured for its bucket, q_len, slot, backend and kind (see
        DecodeGraphs.serves)."""
        return ctx.mode in (Mode.DECODE, Mode.VERIFY) and self.graphs is not None and self.graphs.serves(ctx)

    def replay(self, ctx, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.graphs(ctx, **inputs)

    def prepare_round(self, draft) -> tuple:
        return self.pool.commit_round(draft)

    def round_rows(self, steps) -> int:
        return steps[0].padded_batch_size

    def capture_round(self, fn: Callable[[tuple, dict], torch.Tensor], static: dict[str, torch.Tensor], k: int) -> int:
        """Record fn(steps, inputs), a whole draft round of k steps, per (pool slot, bucket): RoundGraphs."""
        from mstar_attn.capture.graphs import RoundGraphs

        self.round_graphs = RoundGraphs(self.pool, fn, static)
        self.round_graphs.capture(k)
        return len(self.round_graphs.graphs)

    def run_round(self, fn, steps, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        graphs = getattr(self, "round_graphs", None)
        return graphs(steps, **inputs) if graphs is not None else fn(steps, inputs)


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
