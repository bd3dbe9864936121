"""DemoConfig.resolve: this machine's defaults."""

import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn.demo import DemoConfig  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA defaults and messages")
def test_defaults_without_cuda():
    cfg = DemoConfig().resolve()
    assert (cfg.backend, cfg.graphs, cfg.device, cfg.dtype, cfg.hidden) == ("reference", False, "cpu", "float32", 256)
    gpu = DemoConfig(backend="flashinfer").resolve()  # a GPU backend: graphs on, head dim 64
    assert gpu.graphs and gpu.hidden == 512 and gpu.hidden // gpu.heads == 64
