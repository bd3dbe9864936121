"""What the demo runs: DemoConfig (model size, trace, backend, device) and DemoError (a setting that cannot run here)."""

from __future__ import annotations

from typing import Callable

import attrs
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
    model: str = "llama"  # the transformers family: "llama", or "gemma2" (sliding-window layers on their own pages)
    window: int = 8  # gemma2: the sliding window, in tokens (small, so requests outgrow it)
    cascade: str = "off"  # AttentionSpec.cascade: shared system prompts read once per step ("auto", "always")
    compile: str = "off"  # "full": the step's forward through torch.compile(fullgraph=True), attention as custom ops;
    # "piecewise": the same graph split at the attention ops, the pieces between them compiled (mstar_attn.piecewise)

    @property
    def gpu(self) -> bool:
        """A GPU backend (every backend but the reference one), once resolved."""
        return self.backend != "reference"

    def resolve(self) -> DemoConfig:
        """Every None replaced by this machine's default: backend, device and dtype follow whether CUDA
        is visible (flashinfer, cuda, bfloat16; else reference, cpu, float32), graphs and hidden follow
        the backend (on and GPU_HIDDEN for GPU backends; off and 256 for the reference one)."""
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


def transformers_classes(*names: str) -> tuple:
    """The named classes of `transformers`, or DemoError when it is not installed."""
    try:
        import transformers
    except ImportError as e:
        raise DemoError("the demo needs transformers: pip install 'mstar_attn[demo]'") from e
    return tuple(getattr(transformers, n) for n in names)


def seeded_model(make: Callable[[], torch.nn.Module], seed: int, dtype: torch.dtype, device: torch.device,
                 init: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """make() (then init(model)) with torch seeded to `seed` and the global RNG restored after;
    eager attention (the plain-math oracle), on `device` in `dtype`, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
        if init is not None:
            init(model)
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()
