import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=False)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU, Triton kernels (where Triton is installed) run in Triton's interpreter, which must be
# chosen before Triton is first imported: tests/capture/test_derive.py checks them against torch ops.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test starting at the I-th (0-based): N processes with I = 0..N-1 "
                          "split a suite evenly (benchmarks/gpu_suite.sh runs the GPU suite so)")


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected: the shards split what runs)
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    i, n = (int(x) for x in shard.split("/"))
    if not 0 <= i < n:
        raise ValueError(f"--shard {shard}: expected I/N with 0 <= I < N")
    keep = [t for k, t in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[t for k, t in enumerate(items) if k % n != i])
    items[:] = keep
