"""Which device's kernels the model picks for a tensor: its own device's, unless a planner traces
CPU-hosted fake tensors that stand for a GPU's (`trinity-train plan` traces a GPU job on this
machine: the attention must take the GPU's path, not the CPU's fp32 detour)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_STANDS_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernel_device", default=None)


def kernel_device(t: torch.Tensor) -> str:
    """"cuda", "cpu", ...: the device type whose kernels `t` takes."""
    return _STANDS_FOR.get() or t.device.type


@contextlib.contextmanager
def kernels_of(device_type: str) -> Iterator[None]:
    token = _STANDS_FOR.set(device_type)
    try:
        yield
    finally:
        _STANDS_FOR.reset(token)
