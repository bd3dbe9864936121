import os

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
