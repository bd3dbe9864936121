"""The one stateful layer: the double-buffered GraphBufferPool, the committed DeviceStep, CUDA-graph capture."""

from mstar_attn.capture.limits import PoolLimits
from mstar_attn.capture.pool import GraphBufferPool
from mstar_attn.capture.step import DeviceGroup, DeviceStep, MemoryReport

__all__ = ["DeviceGroup", "DeviceStep", "GraphBufferPool", "MemoryReport", "PoolLimits"]
