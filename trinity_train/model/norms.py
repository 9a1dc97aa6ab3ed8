"""Normalisation layers. Both compute in fp32 and cast back, so bf16 activations keep stable
statistics; their parameters are meant to stay in fp32 (DESIGN §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension.

    `unit_offset=False` is the Trinity/T5 form `weight * x / rms(x)`; `unit_offset=True` is the
    Gemma form `(1 + weight) * x / rms(x)`. `init_gain` is the effective gain `reset_parameters`
    sets (e.g. 1/sqrt(L) for Trinity's post norms); the Gemma form stores it minus one, so its
    weight starts at zero.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, init_gain: float = 1.0):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.init_gain = init_gain
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(self.init_gain - 1.0 if self.unit_offset else self.init_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.weight.float()
        if self.unit_offset:
            gain = 1.0 + gain
        return F.rms_norm(x.float(), (x.shape[-1],), gain, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (NormFormer's extra norms), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
