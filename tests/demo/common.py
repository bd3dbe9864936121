"""Shared by the demo tests: the small CPU config and a reference seam that counts its calls."""

from mstar_attn.demo import DemoConfig, StepAttention

SMALL = DemoConfig(requests=6, layers=2, hidden=128, seed=0, backend="reference", device="cpu", dtype="float32")


class Counting(StepAttention):
    """The reference backend, counting the seam's calls."""

    def __init__(self):
        super().__init__("reference")
        self.calls = {"prepare": 0, "write_kv": 0, "run": 0}

    def prepare(self, plan):
        self.calls["prepare"] += 1
        return super().prepare(plan)

    def write_kv(self, ctx, k, v, cache, group=None):
        self.calls["write_kv"] += 1
        super().write_kv(ctx, k, v, cache, group)

    def run(self, ctx, q, cache, group, **kv):
        self.calls["run"] += 1
        return super().run(ctx, q, cache, group, **kv)
