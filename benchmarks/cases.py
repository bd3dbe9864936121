"""Planner benchmark inputs: the step shapes the CPU gate and the GPU host benchmarks share."""

from __future__ import annotations

import numpy as np

from mstar_attn import AttentionSpec, StepBatch

PAGE = 16
NUM_PAGES = 1 << 16  # 1M tokens of cache


def spec(backend: str = "flashinfer") -> AttentionSpec:
    """Llama-3-8B-like attention: 32 query heads, 8 KV heads, head dim 128, bf16."""
    return AttentionSpec(32, 8, 128, PAGE, NUM_PAGES, backend=backend)


def decode(batch_size: int, context: int = 2048, seed: int = 0) -> StepBatch:
    """batch_size decode requests with contexts around `context` tokens, random distinct pages."""
    return verify(batch_size, 1, context, seed)


def verify(batch_size: int, q_len: int, context: int = 2048, seed: int = 0) -> StepBatch:
    """batch_size requests with q_len new tokens each (1: decode, > 1: speculative verify) after
    contexts around `context` tokens (new tokens included), random distinct pages."""
    rng = np.random.default_rng(seed)
    kv = rng.integers(context - 256, context + 256, batch_size).astype(np.int32)
    need = (kv + PAGE - 1) // PAGE
    indptr = np.zeros(batch_size + 1, np.int32)
    np.cumsum(need, out=indptr[1:])
    pages = rng.permutation(NUM_PAGES)[: indptr[-1]].astype(np.int32)
    return StepBatch.from_csr(np.full(batch_size, q_len, np.int32), kv, indptr, pages, PAGE)


def mixed(decodes: int = 60, prefills: int = 4, prompt: int = 512, seed: int = 0) -> StepBatch:
    """Chunked-prefill step: `decodes` decode requests beside `prefills` new prompts."""
    rng = np.random.default_rng(seed)
    q = np.concatenate([np.ones(decodes, np.int32), np.full(prefills, prompt, np.int32)])
    kv = np.concatenate([rng.integers(1024, 3072, decodes), np.full(prefills, prompt)]).astype(np.int32)
    need = (kv + PAGE - 1) // PAGE
    indptr = np.zeros(q.shape[0] + 1, np.int32)
    np.cumsum(need, out=indptr[1:])
    pages = rng.permutation(NUM_PAGES)[: indptr[-1]].astype(np.int32)
    return StepBatch.from_csr(q, kv, indptr, pages, PAGE)


def device_tag() -> str:
    """The GPU's short name for result files: "h100" or "h200" for NVIDIA's H100 and H200 (their SXM, PCIe and NVL
    parts alike), else its name in lower case, letters and digits ("nvidia_gh200_480gb"): a run's files name the
    machine they were measured on."""
    import re

    import torch

    name = torch.cuda.get_device_name()
    for tag in ("H100", "H200"):
        if re.search(rf"(^|[^A-Z]){tag}", name):
            return tag.lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
