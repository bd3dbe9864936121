"""Speculative decoding through mstar_attn: `run_speculative` (`demo --speculate K`).

A draft model proposes K tokens per request in a draft round (build_round: K decode steps planned and
committed at once; on CUDA with graphs the whole round, K forwards with the greedy pick of each
token on the device, replays as one graph), then the target scores all K + 1 positions in one
verify step (with graphs: replayed from the target's verify graph of its bucket) and keeps the longest prefix of proposals equal to its own greedy picks, plus its
next token. Rejected drafts' K/V stays in the caches past each request's length and is
overwritten by the next round; no step reads it. Both models share each request's page ids (each
has its own caches). The draft: "small" is a Llama with the target's first half of the layers, its
embeddings, final norm and lm_head (a layer-skipping draft); "self" is the target itself, whose
proposals are all accepted.

With a tree width W (`demo --speculate K --tree W`) each draft step keeps its W most likely tokens: the
first continues the chain, the others are leaves beside it, so a request's tree has 1 + K * W tokens
(its last token the root). The target verifies the tree in one step (build_tree_plan: each token over its
ancestors, positions by depth), walks down it with its greedy picks, and the accepted path's K/V moves to
where the request continues (accepted_moves + PagedKVCache.move); with graphs the round (each step's W
first choices on the device) and the tree verify step replay as a CUDA graph each; a path that ends on a leaf beside the
chain leaves the draft one position to catch up, as a fully accepted round does.

The check: every request's tokens equal plain greedy decoding of the target (the stock HF model
recomputing the whole sequence per token), and every target logit the engine computed is within
check.REL / ABS of the stock model's (bf16 / fp16: tokens compared up to the first near-tie).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
from torch._dynamo.utils import counters

from mstar_attn import AttentionSpec, DraftTree, PagedKVCache, StepBatch, accepted_moves, build_plan, build_tree_plan
from mstar_attn import step_context
from mstar_attn.demo import llama
from mstar_attn.demo.attention import make_attention
from mstar_attn.demo.check import ABS, REL, Check, check_request
from mstar_attn.demo.config import DTYPES, DemoConfig, DemoError, seeded_model, transformers_classes
from mstar_attn.demo.engine import PageAllocator, compiled_forward, make_trace, static_inputs, step_inputs
from mstar_attn.metadata.draft import MAX_DRAFT_STEPS, build_round
from mstar_attn.metadata.backends import BACKENDS, TREE_BACKENDS
from mstar_attn.metadata.plan import MAX_VERIFY_Q_LEN
from mstar_attn.metadata.tree import MAX_TREE_NODES
from mstar_attn.warmup import warmup


@attrs.define
class SpecResult:
    """What run_speculative did: rounds, proposals, acceptance, target forward passes, the checks."""

    config: DemoConfig
    k: int
    draft: str
    width: int = 0  # tree width W (0: a chain)
    proposed: int = 0
    accepted: int = 0
    catch_up_steps: int = 0  # draft decode steps over the last proposal of a fully accepted round
    plain_steps: int = 0  # target decode steps plain greedy decoding of the batch takes
    replayed_rounds: int = 0
    graph_breaks: int = 0  # --compile: torch._dynamo's graph-break count over the run
    round_graphs: int = 0
    verify_graphs: int = 0  # the target's verify-step graphs captured (--graphs)
    replayed_verify: int = 0  # verify steps replayed from them
    checks: list[Check] = attrs.Factory(list)
    greedy_agree: int = 0  # tokens equal to plain greedy decoding (up to each request's first near-tie off float32)
    greedy_checked: int = 0
    tokens: dict[int, list[int]] = attrs.Factory(dict)
    round_sizes: list[int] = attrs.Factory(list)  # requests drafting in each round
    # where the draft's first choice was not the target's pick (the first such node of a request's round): the
    # target's margin there (logit of its pick - logit of the draft's choice) and the oracle's bound on a logit
    # (check.py): a margin within twice the bound is a near-tie, either token right within the dtype
    misses: list[tuple[float, float]] = attrs.Factory(list)

    @property
    def rounds(self) -> int:
        return len(self.round_sizes)

    @property
    def verify_steps(self) -> int:  # one target verify step per draft round
        return len(self.round_sizes)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def matched(self) -> bool:
        return all(c.ok for c in self.checks) and self.greedy_agree == self.greedy_checked


def draft_model(target, layers: int):
    """A LlamaForCausalLM of the target's first `layers` layers, with its embeddings, final norm and lm_head."""
    (LlamaForCausalLM,) = transformers_classes("LlamaForCausalLM")
    cfg = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": layers})
    p = next(target.parameters())

    def init(m):
        m.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")
                           or int(k.split(".")[2]) < layers})

    return seeded_model(lambda: LlamaForCausalLM(cfg), 0, p.dtype, p.device, init)


def accepted_prefix(proposals: list[int], picks: list[int]) -> int:
    """How many leading proposals equal the target's greedy picks at the same positions (picks has one more:
    the target's token after the last proposal)."""
    kept = 0
    while kept < len(proposals) and proposals[kept] == picks[kept]:
        kept += 1
    return kept


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n tokens of greedy decoding by the stock model, recomputing the whole sequence for each."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens], device=model.device)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


class _Model:
    """One model on the seam: its spec, its Attention layers (each with its cache) and the seam (a pool on GPU backends)."""

    def __init__(self, cfg: DemoConfig, model, num_pages: int, max_batch: int, max_tokens: int, k: int, device,
                 tree_nodes: int = MAX_VERIFY_Q_LEN):
        """tree_nodes: the largest token tree its pool's verify graphs replay (PoolLimits.max_tree_nodes)."""
        self.model, self.device = model, device
        self.forward = _forward(cfg.compile)
        self.spec = AttentionSpec(cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads, cfg.page_size, num_pages,
                                  dtype=DTYPES[cfg.dtype], backend=cfg.backend, **llama.spec_fields(model))
        self.attn = make_attention(cfg)
        self.replayed = 0  # steps replayed from captured verify graphs
        self.layers = self.attn.layers(self.spec, [PagedKVCache.allocate(self.spec, device) for _ in self.spec.layer_groups])
        if cfg.gpu:
            self.attn.bind(self.spec, max_batch, max_tokens, max_draft_steps=k, max_tree_nodes=tree_nodes)
        else:
            self.attn.bind(self.spec, max_batch, max_tokens)

    def step(self, batch: StepBatch, tokens: list[int], tree: DraftTree | None = None) -> torch.Tensor:
        """One step's logits [T, vocab] float32 (with `tree`: a tree verify step): replayed where a captured
        verify graph serves it (capture_verify), else eagerly."""
        plan = build_plan(batch, self.spec) if tree is None else build_tree_plan(batch, self.spec, tree)
        ctx = self.attn.prepare(plan)
        x = step_inputs(plan, tokens, self.attn.token_rows(ctx), self.device)
        self.last_plan = plan
        if self.attn.replays(ctx):
            self.replayed += 1
            return self.attn.replay(ctx, x)[: plan.num_tokens].float()
        return self.forward(self.model, ctx, self.layers, x["ids"], x["positions"])[: plan.num_tokens].float()

    def capture_verify(self, q_len: int, trees: bool) -> int:
        """Capture the verify steps of q_len tokens per request (with `trees`: token-tree verify steps too) per
        pool slot and bucket; returns the number of graphs."""
        return self.attn.capture(lambda ctx, x: self.forward(self.model, ctx, self.layers, x["ids"], x["positions"]),
                                 static_inputs(self.attn.capture_rows * q_len, self.device), q_len=q_len, trees=trees)

    def round_fn(self, steps, x: dict[str, torch.Tensor], width: int = 0) -> torch.Tensor:
        """A draft round: step j feeds the token step j - 1 picked (greedy, on the device); returns [rows, K] int64,
        or with a width W each step's W most likely tokens, [rows, K, W] (the first one fed on)."""
        ids, out = x["ids"], []
        for j, step in enumerate(steps):
            logits = self.forward(self.model, step, self.layers, ids, x["positions"] + j)
            top = logits.argmax(-1, keepdim=True) if not width else logits.topk(width, dim=-1).indices
            ids = top[:, 0].contiguous()  # (a strided view would add a Dynamo guard and a recompile)
            out.append(top if width else ids)
        return torch.stack(out, dim=1)


def _forward(mode: str):
    """llama.forward as the demo's --compile asks (engine.compiled_forward), called with the step: a compiled
    one runs inside step_context(step)."""
    compiled = compiled_forward(llama.forward, mode)
    if compiled is None:
        return llama.forward

    def forward(model, ctx, layers, ids, positions):
        with step_context(ctx):
            return compiled(model, None, layers, ids, positions)
    return forward


def tree_parents(k: int, width: int) -> list[int]:
    """The draft tree of a round: root 0; level d (1..k) is nodes 1 + (d - 1) * width + w, w < width, all children
    of level d - 1's first node (the chain), the others leaves."""
    return [-1] + [0 if d == 1 else 1 + (d - 2) * width for d in range(1, k + 1) for _ in range(width)]


def accept_path(k: int, width: int, tokens: list[int], picks: list[int]) -> list[int]:
    """The accepted root-down path of one request's tree (tokens and the target's greedy picks per node): from the
    root, the child whose token is the target's pick at the current node, while there is one."""
    path = [0]
    while True:
        cur = path[-1]
        level = 0 if cur == 0 else (cur - 1) // width + 1
        if level == k or (cur and (cur - 1) % width):  # (the last level, or a leaf beside the chain)
            return path
        first = 1 + level * width
        nxt = next((c for c in range(first, first + width) if tokens[c] == picks[cur]), None)
        if nxt is None:
            return path
        path.append(nxt)


def run_speculative(cfg: DemoConfig, k: int, draft: str = "small", width: int = 0) -> SpecResult:
    """Serve the trace's requests (all at once) by draft rounds of k tokens and target verify steps (of a draft
    tree of `width` tokens per level where width > 0); check."""
    cfg = cfg.resolve()
    if not 1 <= k <= MAX_DRAFT_STEPS - 1:
        raise DemoError(f"--speculate {k}: a round drafts 1..{MAX_DRAFT_STEPS - 1} tokens")
    if width and not (1 <= width and 1 + k * width <= MAX_TREE_NODES):
        raise DemoError(f"--tree {width}: a tree of 1 + K x W tokens holds at most {MAX_TREE_NODES} (K {k})")
    if width and cfg.backend in BACKENDS and not BACKENDS[cfg.backend].tree:
        raise DemoError(f"--tree: backend {cfg.backend!r} does not verify token trees (backends that do: "
                        f"{', '.join(TREE_BACKENDS)})")
    if draft not in ("small", "self"):
        raise DemoError(f"--draft {draft!r}: 'small' or 'self'")
    if cfg.model != "llama":
        raise DemoError("--speculate serves the llama family")
    if cfg.cascade != "off":
        raise DemoError("--cascade serves plain decoding; --speculate plans draft rounds, which read flat")
    if cfg.compile not in ("off", "full", "piecewise"):
        raise DemoError(f"--compile {cfg.compile!r}: known modes are full (the default), piecewise and off")
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    reqs = make_trace(cfg, np.random.default_rng(cfg.seed))
    ps = cfg.page_size
    n_verify = 1 + k * width if width else k + 1  # a verify step's tokens per request
    num_pages = sum(-(-(len(r.prompt) + r.max_new + n_verify) // ps) for r in reqs)
    B = len(reqs)
    res = SpecResult(cfg, k, draft, width)
    breaks = sum(counters["graph_break"].values())
    with torch.inference_mode():
        target = llama.build_model(cfg, dtype, device)
        drafter = target if draft == "self" else draft_model(target, max(cfg.layers // 2, 1))
        rows = 1 << (B - 1).bit_length()
        tokens_max = sum(len(r.prompt) for r in reqs) + B * n_verify
        t = _Model(cfg, target, num_pages, rows, tokens_max, k, device, max(n_verify, MAX_VERIFY_Q_LEN) if width else MAX_VERIFY_Q_LEN)
        d = _Model(attrs.evolve(cfg, layers=drafter.config.num_hidden_layers), drafter, num_pages, rows, tokens_max, k, device)
        if cfg.gpu:  # the kernels of every kind of step (a round's steps decode on the verify kind's), before the trace
            warmup(t.spec, device=device, trees=bool(width))
        round_fn = (lambda steps, x: d.round_fn(steps, x, width)) if width else d.round_fn
        if cfg.graphs:
            res.round_graphs = d.attn.capture_round(round_fn, static_inputs(max(d.attn.pool.buckets), device), k)
            res.verify_graphs = t.capture_verify(n_verify, trees=bool(width))
        pages = PageAllocator(num_pages)
        for r in reqs:
            r.pages = pages.alloc(-(-len(r.prompt) // ps))
        prompt = StepBatch.from_pages([len(r.prompt) for r in reqs], [len(r.prompt) for r in reqs], [r.pages for r in reqs], ps)
        flat = [x for r in reqs for x in r.prompt]
        logits = t.step(prompt, flat).cpu()
        d.step(prompt, flat)
        drafted = {r.rid: len(r.prompt) for r in reqs}  # positions whose draft K/V is in the draft caches
        at = np.cumsum([0] + [len(r.prompt) for r in reqs])
        for i, r in enumerate(reqs):
            r.logits.append(logits[at[i] : at[i + 1]])
            r.tokens.append(int(logits[at[i + 1] - 1].argmax()))
        live = [r for r in reqs if not r.done]
        while live:
            for r in live:  # pages through the verify step's last token
                r.pages += pages.alloc(-(-(len(r.tokens) - 1 + n_verify) // ps) - len(r.pages))
            behind = [r for r in live if drafted[r.rid] < len(r.tokens) - 1]  # a fully accepted round's last proposal
            if behind:
                d.step(StepBatch.from_pages([1] * len(behind), [len(r.tokens) - 1 for r in behind],
                                            [r.pages for r in behind], ps), [r.tokens[-2] for r in behind])
                res.catch_up_steps += 1
            n = len(live)
            round_ = build_round(StepBatch.from_pages([1] * n, [len(r.tokens) for r in live], [r.pages for r in live], ps),
                                 d.spec, k)
            steps = d.attn.prepare_round(round_)
            R = d.attn.round_rows(steps)
            x = {"ids": torch.tensor([r.tokens[-1] for r in live] + [0] * (R - n), device=device),
                 "positions": torch.tensor([len(r.tokens) - 1 for r in live] + [0] * (R - n), device=device)}
            before = getattr(getattr(d.attn, "round_graphs", None), "replays", 0)
            proposals = d.attn.run_round(round_fn, steps, x)[:n].cpu().tolist()  # [n, k], or [n, k, W] with a tree
            res.replayed_rounds += getattr(getattr(d.attn, "round_graphs", None), "replays", 0) - before
            res.round_sizes.append(n)
            (_verify_tree if width else _verify_chain)(res, t, live, proposals, drafted, ps)
            for r in live:
                if r.done:
                    pages.release(r.pages)
            live = [r for r in live if not r.done]
        res.plain_steps = max(r.max_new for r in reqs) - 1
        res.tokens = {r.rid: r.tokens for r in reqs}
        for r in reqs:
            res.checks.append(check_request(target, r, dtype))
            plain = plain_greedy(target, r.prompt, r.max_new)
            ok = [a == b for a, b in zip(r.tokens[len(r.prompt):], plain)]
            upto = res.checks[-1].tokens_checked if dtype != torch.float32 else len(ok)  # (stops at a near-tie)
            res.greedy_checked += upto
            res.greedy_agree += sum(ok[:upto])
    res.graph_breaks = sum(counters["graph_break"].values()) - breaks
    res.replayed_verify = t.replayed
    return res


def _take(res: SpecResult, r, picks: list[int], rows: torch.Tensor, drafted_kept: int, drafted: dict) -> None:
    """Request r's verify outcome: picks, the target's tokens along its accepted path (the accepted proposals,
    then its next token), rows their logits; drafted_kept of the accepted proposals have draft K/V written (the
    draft catches up the rest). Appends what max_new allows."""
    res.proposed += res.k
    res.accepted += len(picks) - 1
    start = len(r.tokens)
    drafted[r.rid] = start + min(drafted_kept, res.k - 1)
    take = min(len(picks), r.max_new - (start - len(r.prompt)))
    r.tokens += picks[:take]
    r.logits.append(rows[:take])


def _first_miss(res: SpecResult, rows: torch.Tensor, chain: list[int], tokens: list[int], picks: list[int]) -> None:
    """Record (res.misses) the first node of `chain` (the nodes along the draft's first choices, root first;
    tokens: the token of each node) whose next first choice is not the target's pick, with its margin."""
    for node, child in zip(chain, chain[1:]):
        if tokens[child] != picks[node]:
            row = rows[node].float()
            dtype = DTYPES[res.config.dtype]
            res.misses.append((float(row[picks[node]] - row[tokens[child]]),
                               REL[dtype] * float(rows.float().abs().max()) + ABS[dtype]))
            return


def _verify_chain(res: SpecResult, t: _Model, live: list, proposals: list, drafted: dict, ps: int) -> None:
    """The target's verify step of one round of chains (proposals [n][k]): keep each request's proposals equal to
    the target's greedy picks, and its next token."""
    k, n = res.k, len(live)
    verify = StepBatch.from_pages([k + 1] * n, [len(r.tokens) + k for r in live], [r.pages for r in live], ps)
    logits = t.step(verify, [x for r, p in zip(live, proposals) for x in [r.tokens[-1], *p]]).cpu()
    for i, (r, p) in enumerate(zip(live, proposals)):
        rows_i = logits[i * (k + 1) : (i + 1) * (k + 1)]
        picks = rows_i.argmax(-1).tolist()
        kept = accepted_prefix(p, picks)
        _first_miss(res, rows_i, list(range(k + 1)), [r.tokens[-1], *p], picks)
        _take(res, r, picks[: kept + 1], rows_i[: kept + 1], kept, drafted)


def _verify_tree(res: SpecResult, t: _Model, live: list, proposals: list, drafted: dict, ps: int) -> None:
    """The target's tree verify step of one round (proposals [n][k][W]): walk each tree with the target's picks,
    take the accepted tokens and the next one, and move the accepted path's K/V where the request continues."""
    k, width = res.k, res.width
    tree = DraftTree.from_parents([tree_parents(k, width)] * len(live))
    nodes = [[r.tokens[-1]] + [tok for level in p for tok in level] for r, p in zip(live, proposals)]
    batch = StepBatch.from_pages([len(x) for x in nodes], [len(r.tokens) - 1 + len(x) for r, x in zip(live, nodes)],
                                 [r.pages for r in live], ps)
    logits = t.step(batch, [tok for x in nodes for tok in x], tree).cpu()
    paths, n = [], len(nodes[0])
    for i, (r, x) in enumerate(zip(live, nodes)):
        rows_i = logits[i * n : (i + 1) * n]
        picks = rows_i.argmax(-1).tolist()
        path = accept_path(k, width, x, picks)
        _first_miss(res, rows_i, [0] + [1 + level * width for level in range(k)], x, picks)
        paths.append(path)
        chain = next((i for i, node in enumerate(path[1:]) if (node - 1) % width), len(path) - 1)  # drafted tokens kept
        # (the accepted children's tokens are the target's picks at their parents)
        _take(res, r, [picks[j] for j in path], rows_i[path], chain, drafted)
    moves = accepted_moves(t.last_plan, paths)
    if moves.src.size:
        src, dst = (torch.tensor(a, device=t.device) for a in (moves.src, moves.dst))
        for layer in t.layers:
            layer.cache.move(src, dst)


def summary(res: SpecResult) -> str:
    c = res.config
    gen = sum(len(t) for t in res.tokens.values()) - sum(len(r.prompt) for r in make_trace(c, np.random.default_rng(c.seed)))
    drafter = "the target itself" if res.draft == "self" else f"the target's first {max(c.layers // 2, 1)} of {c.layers} layers"
    lines = [
        f"speculate K = {res.k}" + (f", tree W = {res.width} ({1 + res.k * res.width} tokens per verify)" if res.width else "")
        + f": draft = {drafter}; {c.requests} requests, {gen} tokens generated, {c.dtype} on {c.device}, backend {c.backend}",
        f"rounds    {res.rounds} draft rounds ({res.catch_up_steps} catch-up draft steps), {res.proposed} tokens proposed, "
        f"{res.accepted} accepted ({res.acceptance:.0%})",
        f"target    {res.verify_steps} verify steps + 1 prefill, vs {res.plain_steps} decode steps + 1 prefill for plain greedy "
        f"decoding: {res.plain_steps - res.verify_steps} target steps saved",
    ]
    if c.compile != "off":
        lines.append(f"compile   torch.compile(fullgraph=True) of both models' forwards ({c.compile}), attention as "
                     f"mstar_attn custom ops: graph breaks: {res.graph_breaks}")
    if c.graphs:
        lines.append(f"graphs    {res.replayed_rounds} of {res.rounds} draft rounds and {res.replayed_verify} of "
                     f"{res.rounds} verify steps replayed as one CUDA graph each ({res.round_graphs} round graphs, "
                     f"{res.verify_graphs} verify graphs captured)")
    worst = max(res.checks, key=lambda x: x.err / x.tol)
    lines += [
        f"oracle    max |logit diff| {max(x.err for x in res.checks):.2e} (request {worst.rid}: {worst.err:.2e} vs "
        f"{worst.tol:.2e}); tokens equal to plain greedy decoding {res.greedy_agree}/{res.greedy_checked}"
        + ("" if c.dtype == "float32" else " (each request up to its first near-tie)"),
        f"matches transformers: {'yes' if all(x.ok for x in res.checks) else 'no'} (every target logit within its bound)",
        f"matches plain greedy decoding: {'yes' if res.greedy_agree == res.greedy_checked else 'no'}",
    ]
    return "\n".join(lines) + "\n"
