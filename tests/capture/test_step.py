"""capture/step.py: the per-step constructor of a DeviceStep makes what __init__ makes."""

import attrs
import numpy as np

from mstar_attn import build_plan
from mstar_attn.capture.step import DeviceStep
from mstar_attn.metadata.batch import StepRows
from tests.helpers import fresh_seed, pool_of, spec_for


def test_made_is_init_with_the_defaults_of_a_current_stream_commit():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = spec_for(page_size=4, num_pages=320)  # (8 requests x 40 pages)
    pool = pool_of(spec, device="cpu", max_batch_size=16, max_num_tokens=64, max_num_pages=320, max_requests=32,
                   max_pages_per_request=40)
    B = int(rng.integers(1, 9))
    rows = rng.permutation(32)[:B].astype(np.int32)
    kv = rng.integers(1, 100, B).astype(np.int32)
    for i, (r, k) in enumerate(zip(rows, kv)):
        pool.table.assign(int(r), list(range(40 * i, 40 * i + -(-int(k) // 4))))
    step = pool.commit(build_plan(StepRows.decode(rows, kv), spec), defer=True)  # (the derived path: made)
    init = DeviceStep(plan=step.plan, shape=step.shape, generation=step.generation, slots=step.slots)
    made = DeviceStep.made(step.plan, step.shape, step.generation, step.slots)
    assert set(vars(made)) == set(vars(init)), f"seed {seed}"
    for field in attrs.fields(DeviceStep):
        a, b = getattr(init, field.name), getattr(made, field.name)
        assert a is b or a == b, f"seed {seed}: field {field.name}: {a!r} vs {b!r}"
    side = object()  # (a side stream as the step holds it: a commit with stream=, checked before it gets here)
    assert DeviceStep.made(step.plan, step.shape, step.generation, step.slots, side).stream is side is DeviceStep(
        plan=step.plan, shape=step.shape, generation=step.generation, slots=step.slots, stream=side).stream, f"seed {seed}"
    made.mark_stored(None)
    assert made.kv_stored and not init.kv_stored and not step.kv_stored, f"seed {seed}: flags are not shared"
    assert step.live and step.slot == step.shape.slot and step.padded_batch_size >= B, f"seed {seed}"
