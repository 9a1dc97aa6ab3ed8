"""Learning-rate schedules: warmup-stable-decay (WSD), cosine and constant, all with linear warmup.

The schedule is a multiplier on each parameter group's own peak learning rate (AdamW and Muon
groups have different peaks), applied through `torch.optim.lr_scheduler.LambdaLR`, so its state
(`last_epoch`, base learning rates) checkpoints like any other scheduler. Step `s` counts applied
optimizer steps from 0; the optimizer step with index `s` runs at `peak * lr_multiplier(s)`.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from trinity_train.config import Config, OptimConfig


def lr_multiplier(step: int, optim_cfg: OptimConfig, total_steps: int) -> float:
    """The fraction of the peak learning rate used by optimizer step `step` (0-based)."""
    # Warmup starts at 1/warmup rather than 0: a step at learning rate 0 would be wasted.
    warmup = optim_cfg.warmup_steps
    warmup_mult = (step + 1) / warmup if step < warmup else 1.0
    floor = optim_cfg.min_lr_ratio

    if optim_cfg.schedule == "constant":
        return warmup_mult
    if optim_cfg.schedule == "cosine":
        span = max(1, total_steps - warmup)
        progress = min(1.0, max(0.0, (step - warmup) / span))
        cosine = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return warmup_mult if step < warmup else cosine
    if optim_cfg.schedule == "wsd":
        decay_steps = round(optim_cfg.decay_fraction * total_steps)
        decay_start = total_steps - decay_steps
        if decay_steps == 0 or step < decay_start:
            return warmup_mult
        # Linear from 1 at the first decay step towards `floor`, which the step after the last
        # would reach; min() keeps a warmup that overlaps the decay from jumping above it.
        progress = min(1.0, (step - decay_start) / decay_steps)
        return min(warmup_mult, 1.0 - (1.0 - floor) * progress)
    raise ValueError(f"unknown schedule {optim_cfg.schedule!r}")  # validate() rejects it earlier


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> LambdaLR:
    """A LambdaLR scaling every parameter group's peak rate by `lr_multiplier`."""
    # functools.partial rather than a lambda keeps the scheduler's state_dict picklable.
    multiplier = functools.partial(lr_multiplier, optim_cfg=cfg.optim, total_steps=cfg.train.steps)
    return LambdaLR(optimizer, lr_lambda=multiplier)
