"""Which device's kernels the model picks for a tensor: its own device's, unless a planner traces
CPU-hosted fake tensors that stand for a GPU's (`trinity-train plan` traces a GPU job on this
machine: the attention must take the GPU's path, not the CPU's fp32 detour)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# A module global, not a ContextVar: torch.compile reads a global under a guard, while a
# ContextVar's get() is outside what dynamo traces (the compiled blocks would fall back to eager).
_stands_for: str | None = None


def kernel_device(t: torch.Tensor) -> str:
    """"cuda", "cpu", ...: the device type whose kernels `t` takes."""
    return _stands_for or t.device.type


@contextlib.contextmanager
def kernels_of(device_type: str) -> Iterator[None]:
    """Within the block, tensors take `device_type`'s kernels (the planner's trace is one thread)."""
    global _stands_for
    before, _stands_for = _stands_for, device_type
    try:
        yield
    finally:
        _stands_for = before
