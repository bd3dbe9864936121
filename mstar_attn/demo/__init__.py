"""End-to-end demo: a small random Llama (or Gemma 2, BART, gpt-oss) from `transformers`, served through mstar_attn,
checked against it.

The engine here is a toy (one process, greedy sampling, whole-prompt prefill) but its attention is the
real thing: every layer of every step goes build_plan -> prepare -> write_kv -> run over a paged KV
cache, with requests arriving mid-flight (MIXED steps), sharing prompt-prefix pages, finishing at
different lengths and handing their pages to newcomers. On a GPU backend with graphs on (the CUDA
default) the whole decode forward (embedding, every layer's write_kv + run and the rest of the layer
math, lm_head) is captured once per (pool slot, bucket) and each decode step replays one CUDA graph;
prefill, mixed and extend steps run eagerly. At the end the stock HF model (eager attention, no cache,
full sequences) recomputes every logit the engine computed.

    python -m mstar_attn demo [--backend reference] [--graphs] [--layers 4] [--hidden 256] [--requests 8] ...

Modules, each importing only those above it:
    config.py     DemoConfig, DemoError, DTYPES, GPU_HIDDEN
    attention.py  the attention seam: StepAttention (eager), PoolAttention (GPU pool, CUDA graphs), make_attention
    engine.py     PageAllocator, Request, make_trace, share_prefix; Engine: one step's forward, eager or replayed, timed
    llama.py      the model adapter: build_model, spec_fields, forward (HF Llama modules, RoPE, attention through the seam)
    gemma2.py     Gemma 2: sliding-window layers on their own page lists (LayerGroup.own_pages), soft-caps
    bart.py       BART, an encoder-decoder: the encoder on the dense path, cross attention on paged encoder K/V
    gpt_oss.py    gpt-oss: attention sinks (each layer's own), sliding-window and full layers, experts
    check.py      the check against transformers: Check, check_request, the tolerances REL / ABS
    report.py     DemoResult, Progress, summary, write
    run.py        run_demo: the serving loop
"""

from mstar_attn.demo.attention import PoolAttention, StepAttention, make_attention
from mstar_attn.demo.check import ABS, REL, Check, check_request
from mstar_attn.demo.config import DTYPES, GPU_HIDDEN, DemoConfig, DemoError
from mstar_attn.demo.engine import Engine, PageAllocator, Request, make_trace, share_prefix
from mstar_attn.demo.report import DemoResult, Progress, summary, write
from mstar_attn.demo.run import run_demo

__all__ = [
    "ABS", "Check", "DTYPES", "DemoConfig", "DemoError", "DemoResult", "Engine", "GPU_HIDDEN", "PageAllocator",
    "PoolAttention", "Progress", "REL", "Request", "StepAttention", "check_request", "make_attention", "make_trace",
    "run_demo", "share_prefix", "summary", "write",
]
