"""The one exception family the package raises for bad input. Imports nothing."""

from __future__ import annotations


class PlanError(ValueError):
    """Malformed input, raised by `StepBatch`, `build_plan`, `GraphBufferPool.commit` and the
    argument checks of every backend's `run` / `write_kv`.

    The message names the field (or argument) and, where there is one, the request index.
    """


class StaleStepError(PlanError):
    """A `DeviceStep` whose pool slot has been committed again since: its device buffers now hold
    another step, so running it would silently read the wrong pages."""
