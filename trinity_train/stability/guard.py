"""Decide whether an optimizer step is applied, skipped, or ends in a rollback (DESIGN §7).

The verdict depends only on the step's global loss and global pre-clip gradient norm (reduced over
all ranks before this is called) and on the guard's own history, which is identical on every rank,
so every rank takes the same branch without further communication.

- A step whose loss or gradient norm is not finite is skipped (`skip_nonfinite`).
- Loss and gradient norm are each judged by a robust one-sided z-score on log values against the
  course (a robust line) of the last `window` normal steps (`detector.RollingSignal`); a z of at
  least `spike_zscore` on either skips the step. No z-based verdict during the learning-rate warm-up (`optim.warmup_steps`): the
  windows start filling when it ends, and judge once they hold `min_history` values.
- A step at `incident_zscore` or above (or any skip) opens an incident at that step, its onset;
  `calm_steps` normal steps in a row close it. While a signal is at incident level its values stay
  out of its window, so a slow divergence cannot drag the window up after it: it keeps rising
  against the calm baseline until it crosses `spike_zscore` and is skipped.
- `rollback_after` skips in a row ask the trainer to roll back to a checkpoint from before the
  incident's onset (it restores this guard with everything else, but keeps the windows it had
  built up to the incident); `max_consecutive_skips` in a row halt the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trinity_train.config import StabilityConfig
from trinity_train.errors import UserError
from trinity_train.records import EventName, event
from trinity_train.stability.detector import RollingSignal

HALT_EXIT_CODE = 3  # the run stopped itself as diverged; distinct from bad input (1) and config (2)


class TrainingDivergedError(UserError):
    """Training cannot continue: the guard or the rollback policy gave up."""

    exit_code = HALT_EXIT_CODE


@dataclass
class Incident:
    """An open episode of abnormal steps, from its onset on."""

    onset_iter: int
    onset_step: int  # optimizer steps applied before the onset step
    signal: str  # "nonfinite", "loss" or "grad_norm": what first looked wrong
    z: float | None
    calm: int = 0  # normal steps in a row since the last abnormal one


@dataclass(frozen=True)
class Verdict:
    apply: bool
    reason: str = ""  # why a step is skipped: "nonfinite", "loss_spike" or "grad_spike"
    loss_z: float | None = None
    grad_norm_z: float | None = None
    rollback: bool = False  # skipped, and the streak of skips asks for a rollback
    onset_iter: int | None = None  # the open incident's onset, if any
    onset_step: int | None = None
    events: tuple[dict, ...] = field(default=(), compare=False)  # incident_open / incident_close


def _at_least(z: float | None, threshold: float) -> bool:
    return threshold > 0 and z is not None and z >= threshold


class StepGuard:
    def __init__(self, cfg: StabilityConfig, warmup_steps: int = 0):
        self.cfg = cfg
        self.warmup_steps = warmup_steps
        self.loss = RollingSignal(cfg.window, cfg.min_history, cfg.loss_sigma_floor)
        self.grad_norm = RollingSignal(cfg.window, cfg.min_history, cfg.grad_norm_sigma_floor)
        self.consecutive_skips = 0
        self.incident: Incident | None = None

    def judge(self, loss: float, grad_norm: float, iteration: int, steps_applied: int) -> Verdict:
        """The verdict for one step (`steps_applied` optimizer steps came before it); raises
        TrainingDivergedError after `max_consecutive_skips` skips in a row."""
        cfg = self.cfg
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        judging = steps_applied >= self.warmup_steps
        loss_z = self.loss.zscore(loss, steps_applied) if judging else None
        grad_z = self.grad_norm.zscore(grad_norm, steps_applied) if judging else None

        if cfg.skip_nonfinite and not finite:
            reason = "nonfinite"
        elif _at_least(loss_z, cfg.spike_zscore):
            reason = "loss_spike"
        elif _at_least(grad_z, cfg.spike_zscore):
            reason = "grad_spike"
        else:
            reason = ""
        apply = not reason
        loss_odd, grad_odd = _at_least(loss_z, cfg.incident_zscore), _at_least(grad_z, cfg.incident_zscore)
        events = self._follow_incident(iteration, steps_applied, finite, loss_z, grad_z,
                                       abnormal=not finite or not apply or loss_odd or grad_odd)

        if apply:
            self.consecutive_skips = 0
            if judging:  # only normal values of steps after warm-up judge later steps
                if not loss_odd:
                    self.loss.add(loss, steps_applied)
                if not grad_odd:
                    self.grad_norm.add(grad_norm, steps_applied)
        else:
            self.consecutive_skips += 1
            if self.consecutive_skips >= cfg.max_consecutive_skips:
                raise TrainingDivergedError(
                    f"training diverged: {self.consecutive_skips} steps in a row were skipped (last at "
                    f"iteration {iteration}, reason: {reason}; stability.max_consecutive_skips); lower "
                    "optim.lr or train.grad_clip and resume with --checkpoint.resume=auto, or resume from "
                    "an earlier checkpoint with --checkpoint.resume=PATH")
        incident = self.incident
        return Verdict(apply, reason, loss_z, grad_z,
                       rollback=not apply and 0 < cfg.rollback_after <= self.consecutive_skips,
                       onset_iter=incident.onset_iter if incident else None,
                       onset_step=incident.onset_step if incident else None, events=tuple(events))

    def _follow_incident(self, iteration: int, steps_applied: int, finite: bool, loss_z: float | None,
                         grad_z: float | None, abnormal: bool) -> list[dict]:
        if abnormal:
            if self.incident is None:
                signal, z = (("nonfinite", None) if not finite else
                             ("loss", loss_z) if (loss_z or 0) >= (grad_z or 0) else ("grad_norm", grad_z))
                self.incident = Incident(iteration, steps_applied, signal, z)
                return [event(EventName.INCIDENT_OPEN, iter=iteration, step=steps_applied, signal=signal, z=z)]
            self.incident.calm = 0
            return []
        if self.incident is not None:
            self.incident.calm += 1
            if self.incident.calm >= self.cfg.calm_steps:
                closed, self.incident = self.incident, None
                return [event(EventName.INCIDENT_CLOSE, iter=iteration, onset_iter=closed.onset_iter,
                              calm_steps=closed.calm)]
        return []

    def windows(self) -> dict:
        """The normal history of both signals (to carry across a rollback)."""
        return {"loss": self.loss.state_dict(), "grad_norm": self.grad_norm.state_dict()}

    def keep_windows(self, windows: dict) -> None:
        """Judge on from `windows` rather than the restored ones: after a rollback the history
        up to the incident (normal steps the undone timeline took too) is the best baseline, and a
        checkpoint from early in the run may hold too little history to judge at all."""
        self.loss.load_state_dict(windows["loss"])
        self.grad_norm.load_state_dict(windows["grad_norm"])

    def state_dict(self) -> dict:
        # The same keys whether or not an incident is open (DCP loads into the current keys), so
        # the incident is one list value: empty, or its fields in order.
        incident = [] if self.incident is None else list(vars(self.incident).values())
        return {"loss": self.loss.state_dict(), "grad_norm": self.grad_norm.state_dict(),
                "consecutive_skips": self.consecutive_skips, "incident": incident}

    def load_state_dict(self, state: dict) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        self.consecutive_skips = state["consecutive_skips"]
        self.incident = Incident(*state["incident"]) if state["incident"] else None
