"""What the pool and `kernels.run` need of a backend: the written protocol.

A backend is one module under kernels/ plus one line in `metadata.backends.BACKENDS` (its
Capabilities: the dtypes, head dims, modes and features it serves, as data). The module exposes

    write_kv(step, k, v, cache, group=None)      store the step's new K/V in the paged cache
    run(step, q, cache, group=None, k=None, v=None, sinks=None) -> out   attention for one layer of `group`
                                                 (sinks: the layer's, where its group has them; a backend
                                                 without Capabilities.sinks checks there are none); out is a
                                                 new tensor, never q or a buffer the backend keeps (the
                                                 mstar_attn.forward op returns it as its output)
    PoolState(pool)  (backends that keep device state per pool; host-only backends have none)

and its PoolState is a `PoolStateBase`: `GraphBufferPool.commit` calls

    check(plan, bucket)     first: PlanError for what this backend cannot serve, before any state changes
    gather(step)            StepRows steps only: device work after the pool's page arrays (dense page
                            tables), in the commit's device work (captured per bucket): no host arrays
                            read; it runs before schedule, except for a lazy_host_arrays state on
                            a bucketed step, whose device work follows schedule (or is deferred)
    schedule(step)          host-side scheduling; returns one run object per layer group, which
                            run() reads as step.scheduled[group]
    schedule_round(steps)   the same for the K steps of a draft round (default: schedule each)
    steady(step)            after schedule, for a deferred plain StepRows decode step (steady.decode_rows) or
                            listed one (steady.decode_lists): a SteadyTerms (capture/steady.py)
                            promising that its schedule serves the slot's next decode steps of the same
                            rows whose lengths lie in given ranges (a cross group's: the same encoder
                            lengths, which the pool keeps), so the pool may skip check and
                            schedule for them; or None, no promise (the default)
    memory()                {name: (device bytes, pinned bytes)} of what it holds

`lazy_host_arrays` True promises that schedule reads a derived step's pinned O(rows) arrays, and
copies anything to the device, only after `pool.stage_host(step)` (or `pool.upload`): the pool then
leaves them unwritten, and proves the commit by its graph's fence instead of an event, whenever
neither happened. `schedule_reads_rows` True says schedule reads the step's device table_rows (a CrossRows
group's, gathered there): the pool then never derives such a step's cross rows on the device, which would
reach them only with the step's device work, after schedule.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mstar_attn.capture.steady import SteadyTerms
    from mstar_attn.capture.step import DeviceStep
    from mstar_attn.metadata.plan import AttentionPlan


@runtime_checkable
class PoolState(Protocol):
    """What GraphBufferPool.commit calls on a backend's per-pool state (see the module doc)."""

    lazy_host_arrays: bool
    schedule_reads_rows: bool

    def check(self, plan: AttentionPlan, bucket: int | None) -> None: ...
    def gather(self, step: DeviceStep) -> None: ...
    def schedule(self, step: DeviceStep) -> tuple: ...
    def schedule_round(self, steps: list[DeviceStep]) -> list[tuple]: ...
    def steady(self, step: DeviceStep) -> SteadyTerms | None: ...
    def memory(self) -> dict[str, tuple[int, int]]: ...


class PoolStateBase:
    """A PoolState's defaults: nothing to refuse or gather, rounds scheduled step by step, host
    arrays staged eagerly. Subclasses override what their backend does."""

    lazy_host_arrays = False
    schedule_reads_rows = False

    def check(self, plan: AttentionPlan, bucket: int | None) -> None:
        """PlanError for what this backend cannot serve (default: nothing beyond build_plan and the pool)."""

    def gather(self, step: DeviceStep) -> None:
        """Device work after the pool's page arrays (default: none; a subclass written before the rename
        that defines `expand` instead: that, with a DeprecationWarning)."""
        expand = getattr(type(self), "expand", None)
        if callable(expand):
            warnings.warn(f"{type(self).__name__}.expand: name the hook gather (kernels/base.py)", DeprecationWarning, 2)
            expand(self, step)

    def schedule(self, step: DeviceStep) -> tuple:
        raise NotImplementedError

    def schedule_round(self, steps: list[DeviceStep]) -> list[tuple]:
        """One run object per layer group for each step of a draft round."""
        return [self.schedule(st) for st in steps]

    def steady(self, step: DeviceStep) -> SteadyTerms | None:
        """No promise: every step of this backend takes the pool's general commit (check and schedule)."""
        return None

    def memory(self) -> dict[str, tuple[int, int]]:
        return {}


def __getattr__(name: str):
    """The names before the rename (Scheduler, SchedulerBase), with a DeprecationWarning."""
    new = {"Scheduler": "PoolState", "SchedulerBase": "PoolStateBase"}.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"mstar_attn.kernels.base.{name} is deprecated: use {new}", DeprecationWarning, 2)
    return globals()[new]
