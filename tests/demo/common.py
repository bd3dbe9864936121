"""Shared by the demo tests: the small CPU config and a reference seam that counts its layers' calls."""

from mstar_attn import Attention
from mstar_attn.demo import DemoConfig, StepAttention

SMALL = DemoConfig(requests=6, layers=2, hidden=128, seed=0, backend="reference", device="cpu", dtype="float32")


class Counting(StepAttention):
    """The reference backend, counting the seam's prepare calls and its layers' stores and attention calls."""

    def __init__(self):
        super().__init__("reference")
        self.calls = {"prepare": 0, "write_kv": 0, "run": 0}
        calls = self.calls

        class Counted(Attention):
            def store(self, k, v, step):
                calls["write_kv"] += 1
                super().store(k, v, step)

            def forward(self, q, k, v, step):
                calls["run"] += 1
                return super().forward(q, k, v, step)

            def attend(self, q, step):
                calls["run"] += 1
                return super().attend(q, step)

        self.layer_class = Counted

    def prepare(self, plan):
        self.calls["prepare"] += 1
        return super().prepare(plan)
