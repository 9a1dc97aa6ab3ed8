"""The dtype a model computes in, for code that autocast does not cover."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: autocast's when it is on for x's device, else x's own
    (`torch._grouped_mm` and the fused loss's GEMMs cast to this, as `nn.Linear` would)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
