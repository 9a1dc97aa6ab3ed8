"""Learning-rate schedules: warmup-stable-decay (WSD), cosine, linear and constant, all with linear warmup.

The schedule is a multiplier on each parameter group's own peak learning rate (AdamW and Muon
groups have different peaks), applied through `torch.optim.lr_scheduler.LambdaLR`. Step `s`
counts applied optimizer steps from 0; the optimizer step with index `s` runs at
`peak * lr_multiplier(s)`.

What a resume takes from the checkpoint is the schedule's *position* only (`last_epoch`, the
applied steps). The peaks (`optim.lr`, `optim.muon_lr`), the schedule's shape and its length
(`train.steps`) are those of the config the run starts with, so `--optim.lr=...` at a resume takes
effect from the resumed step on (a plain LambdaLR would restore the old peaks). Changing
`train.steps` re-plans the schedule for the new length at the same position: the step after a
resume runs at `peak * lr_multiplier(step, new length)`. Extending a finished WSD run therefore
goes back to the stable phase (no warmup again) and decays over the new last
`decay_fraction` of steps; it never trains at the old schedule's final rate of 0. To extend a WSD
run the usual way, resume from a checkpoint taken before its decay began. `replanned` says what
such a resume chose (the run records it and prints it).

Every schedule's top is `optim.peak_lr_ratio` of the peaks (1 for a run from scratch) and its
floor `optim.min_lr_ratio` of them, so a phase that continues a trained run expresses its curve
in fractions of the run's own peaks: Trinity's context extension continues the cosine from 1/10
to 1/20 (`cosine`, ratios 0.1 and 0.05, no warmup), or re-warms linearly to 1/10 and decays
linearly to 0 (`linear`, Nano and Mini; docs/guides/context-extension.md).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from trinity_train.config import Config, OptimConfig
from trinity_train.records import EventName, event


def lr_multiplier(step: int, optim_cfg: OptimConfig, total_steps: int) -> float:
    """The fraction of the peak learning rate used by optimizer step `step` (0-based)."""
    # Warmup starts at 1/warmup rather than 0: a step at learning rate 0 would be wasted.
    warmup = optim_cfg.warmup_steps
    top, floor = optim_cfg.peak_lr_ratio, optim_cfg.min_lr_ratio
    warmup_mult = top * (step + 1) / warmup if step < warmup else top

    if optim_cfg.schedule == "constant":
        return warmup_mult
    if optim_cfg.schedule in ("cosine", "linear"):
        if step < warmup:
            return warmup_mult
        # From the top at the first step after warmup to `floor` at step `total_steps`.
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - warmup)))
        if optim_cfg.schedule == "linear":
            return top - (top - floor) * progress
        return floor + (top - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if optim_cfg.schedule == "wsd":
        decay_steps = round(optim_cfg.decay_fraction * total_steps)
        decay_start = total_steps - decay_steps
        if decay_steps == 0 or step < decay_start:
            return warmup_mult
        # Linear from the top at the first decay step towards `floor`, which the step after the
        # last would reach; min() keeps a warmup that overlaps the decay from jumping above it.
        progress = min(1.0, (step - decay_start) / decay_steps)
        return min(warmup_mult, top - (top - floor) * progress)
    raise ValueError(f"unknown schedule {optim_cfg.schedule!r}")  # validate() rejects it earlier


class ConfiguredSchedule(LambdaLR):
    """A LambdaLR whose checkpoint restores where the schedule is, not what it is.

    `load_state_dict` keeps this object's peaks (`base_lrs`, from the optimizer as the config
    built it) and multiplier (the config's schedule and `train.steps`), takes the position from
    the checkpoint, and sets every group's learning rate for that position. It does not matter
    whether the optimizer's own state is loaded before or after: `OptimizerState` keeps the
    configured hyperparameters of every group (checkpoint/stateful.py).
    """

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        # The same expression as LambdaLR.get_lr, so an unchanged config resumes bit-identically.
        lrs = [base_lr * lmbda(self.last_epoch) for lmbda, base_lr in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> ConfiguredSchedule:
    """A LambdaLR scaling every parameter group's peak rate by `lr_multiplier`."""
    # functools.partial rather than a lambda keeps the scheduler's state_dict picklable.
    multiplier = functools.partial(lr_multiplier, optim_cfg=cfg.optim, total_steps=cfg.train.steps)
    return ConfiguredSchedule(optimizer, lr_lambda=multiplier)


def replanned(previous: Config, cfg: Config, step: int) -> dict | None:
    """The `schedule_replanned` event of a resume at `step` whose `train.steps` differs from the
    checkpoint's run on a schedule that decays (a constant one does not depend on the length), or
    None: the `optim.lr` rate of the last step trained and of the next one."""
    if previous.train.steps == cfg.train.steps or cfg.optim.schedule == "constant":
        return None
    before = previous.optim.lr * lr_multiplier(max(0, step - 1), previous.optim, previous.train.steps)
    after = cfg.optim.lr * lr_multiplier(step, cfg.optim, cfg.train.steps)
    return event(EventName.SCHEDULE_REPLANNED, step=step, schedule=cfg.optim.schedule,
                 from_steps=previous.train.steps, to_steps=cfg.train.steps, lr_from=before, lr_to=after)


def describe_replanned(replan: dict) -> str:
    """The console line of a `schedule_replanned` event."""
    ratio = f" ({replan['lr_to'] / replan['lr_from']:.1f}x)" if replan["lr_from"] > 0 else ""
    return (f"notice: train.steps {replan['from_steps']} -> {replan['to_steps']} re-plans the {replan['schedule']} "
            f"schedule at step {replan['step']}: optim.lr's rate jumps from {replan['lr_from']:.3g} to "
            f"{replan['lr_to']:.3g}{ratio}; to keep the old curve, resume from a checkpoint before its decay")
