"""`Stateful` adapters that let DCP save and restore the model, the optimizer and the RNG streams.

`torch.distributed.checkpoint` calls `state_dict()` on save and, on load, `state_dict()` (for
the tensors to load into, in place) then `load_state_dict()`. The model and optimizer go
through `torch.distributed.checkpoint.state_dict`, which keys optimizer state by parameter
name and understands FSDP2/DTensor, so a checkpoint survives a change of parallel layout.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class ModelState:
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """The optimizer's per-parameter state (moments, momentum buffers, step counts).

    A checkpoint also stores each group's hyperparameters (lr, betas, weight decay, Muon's
    momentum ...), but loading keeps the ones the run's config gave the optimizer: the config is
    what the user asked for at this start (`--optim.weight_decay=...` at a resume takes effect),
    and the learning rate at the resumed position is set by the schedule (optim/schedule.py).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)


class RNGState:
    """Every random stream a step could draw from: torch (CPU and CUDA), Python, NumPy."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        if "cuda" in state_dict:
            torch.cuda.set_rng_state_all(state_dict["cuda"])

