"""Where a rollback goes, what it skips, and how the learning rate backs off after it (DESIGN §7).

Pure decisions from the config and the run's rollback history; the trainer does the restoring.

- Target: the newest sound checkpoint at least `rollback_lookback` steps before the incident's
  onset (instability usually starts a little before the loss jumps, so the newest checkpoint may
  already hold it; PaLM restarted about 100 steps before a spike).
- Skip window: every batch from the restored position through the trigger, plus
  `skip_extra_batches` beyond it (PaLM skipped 200-500 batches around a spike).
- A repeat (an incident whose onset lies within `repeat_window` iterations of the previous
  rollback) goes one checkpoint further back than the previous target and doubles the extra skip;
  the learning-rate factor `lr_backoff` is raised to the power of the repeat depth.
- After `max_rollbacks` rollbacks (counted over the run's whole history, resumes included) the
  run halts.

The history lives in the skip ledger (each rollback range carries its plan), not in a checkpoint:
a rollback restores checkpointed state from before itself, and must still know it happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import StabilityConfig
from trinity_train.data.ledger import SkipRange
from trinity_train.stability.guard import TrainingDivergedError


@dataclass(frozen=True)
class RollbackPlan:
    max_target_step: int  # restore the newest sound checkpoint at or before this step
    extra_batches: int  # batches skipped beyond the trigger
    lr_scale: float  # learning-rate factor right after the rollback, ramping back to 1
    repeat: int  # 0: a first incident; n: the n-th repeat in a row soon after a rollback


def plan_rollback(cfg: StabilityConfig, history: list[SkipRange], onset_iter: int, onset_step: int,
                  iteration: int) -> RollbackPlan:
    """The plan for a rollback asked for at `iteration` by the incident that began at `onset_iter`
    (after `onset_step` applied steps); raises TrainingDivergedError once the allowance is spent."""
    if len(history) >= cfg.max_rollbacks:
        raise TrainingDivergedError(
            f"training diverged: another incident at iteration {iteration} after {len(history)} rollbacks "
            f"(stability.max_rollbacks = {cfg.max_rollbacks}); the loss or gradient norm keeps spiking. "
            "Look at `trinity-train incidents RUN_DIR`, then lower optim.lr / optim.muon_lr or "
            "train.grad_clip, or set stability.lr_backoff below 1, and resume with "
            "--checkpoint.resume=auto (or from an earlier checkpoint with --checkpoint.resume=PATH)")
    last = history[-1] if history else None
    if last is not None and onset_iter - last.iteration <= cfg.repeat_window:
        repeat = int(last.details.get("repeat", 0)) + 1
        return RollbackPlan(max_target_step=int(last.details["target_step"]) - 1,
                            extra_batches=2 * int(last.details.get("extra_batches", cfg.skip_extra_batches)),
                            lr_scale=cfg.lr_backoff ** (repeat + 1), repeat=repeat)
    return RollbackPlan(max_target_step=onset_step - cfg.rollback_lookback,
                        extra_batches=cfg.skip_extra_batches, lr_scale=cfg.lr_backoff, repeat=0)


def protected_lookback(cfg: StabilityConfig) -> int | None:
    """How far back checkpoint retention must keep a checkpoint for a rollback (None: rollbacks
    are off)."""
    return cfg.rollback_lookback if cfg.rollback_after > 0 else None


class LRBackoff:
    """A factor on every group's learning rate after a rollback: `scale` at the restored step,
    rising linearly back to 1 over `ramp_steps` optimizer steps. Checkpointed with the run."""

    def __init__(self):
        self.scale, self.start_step, self.ramp_steps = 1.0, 0, 0

    def start(self, step: int, scale: float, ramp_steps: int) -> None:
        self.scale, self.start_step, self.ramp_steps = scale, step, ramp_steps

    def factor(self, step: int) -> float:
        if self.scale >= 1.0:
            return 1.0
        if self.ramp_steps <= 0:
            return self.scale
        progress = min(1.0, max(0.0, (step - self.start_step) / self.ramp_steps))
        return self.scale + (1.0 - self.scale) * progress

    def apply(self, optimizer, scheduled: list[float], step: int) -> float:
        """Set each group's learning rate for `step` to its `scheduled` rate (the scheduler's
        `get_last_lr()`) times the factor; returns the factor."""
        factor = self.factor(step)
        for group, lr in zip(optimizer.param_groups, scheduled):
            group["lr"] = lr * factor
        return factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "start_step": self.start_step, "ramp_steps": self.ramp_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.start_step, self.ramp_steps = state["scale"], state["start_step"], state["ramp_steps"]
