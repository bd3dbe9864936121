"""Device side: the double-buffered GraphBufferPool and CUDA-graph capture."""

from mstar_attn.capture.pool import DeviceStep, GraphBufferPool

__all__ = ["DeviceStep", "GraphBufferPool"]
