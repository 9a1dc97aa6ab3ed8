"""Decide whether an optimizer step is applied or skipped, from global scalars.

The verdict depends only on the step's global loss and global gradient norm (reduced over all
ranks before this is called) and on this guard's own history, which is identical on every rank;
so every rank takes the same branch without further communication.

A step is skipped when its loss or gradient norm is not finite (`skip_nonfinite`), or, with
`spike_zscore > 0`, when its loss lies more than that many standard deviations above the mean
of the last `window` applied steps. Skipped losses stay out of the history, so one spike does not
widen the band that judges the next. With `rollback_after`, that many skips in a row ask the
trainer to roll back to its newest checkpoint (it restores this guard's state with the rest).
Too many skips in a row mean the run has diverged.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from trinity_train.config import StabilityConfig
from trinity_train.errors import UserError


class TrainingDivergedError(UserError):
    """Training cannot continue: every recent step was rejected."""


@dataclass(frozen=True)
class Verdict:
    apply: bool
    reason: str = ""  # why a step is skipped: "nonfinite" or "spike"
    zscore: float | None = None
    rollback: bool = False  # skipped, and the streak of skips asks for a rollback


class StepGuard:
    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.recent_losses: deque[float] = deque(maxlen=cfg.window)
        self.consecutive_skips = 0

    def zscore(self, loss: float) -> float | None:
        if len(self.recent_losses) < self.cfg.min_history:
            return None
        std = statistics.pstdev(self.recent_losses)
        return (loss - statistics.fmean(self.recent_losses)) / std if std > 0 else None

    def judge(self, loss: float, grad_norm: float, iteration: int) -> Verdict:
        """The verdict for one step; raises TrainingDivergedError after too many skips in a row."""
        z = self.zscore(loss) if math.isfinite(loss) else None
        if self.cfg.skip_nonfinite and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            verdict = Verdict(False, "nonfinite", z)
        elif self.cfg.spike_zscore > 0 and z is not None and z > self.cfg.spike_zscore:
            verdict = Verdict(False, "spike", z)
        else:
            verdict = Verdict(True, "", z)

        if verdict.apply:
            self.consecutive_skips = 0
            self.recent_losses.append(loss)
        else:
            self.consecutive_skips += 1
            if 0 < self.cfg.rollback_after <= self.consecutive_skips:
                verdict = Verdict(False, verdict.reason, z, rollback=True)
            if self.consecutive_skips >= self.cfg.max_consecutive_skips:
                raise TrainingDivergedError(
                    f"training diverged: {self.consecutive_skips} steps in a row were skipped "
                    f"(last at iteration {iteration}, reason: {verdict.reason}); lower optim.lr or "
                    "train.grad_clip, or resume from an earlier checkpoint with --checkpoint.resume=PATH")
        return verdict

    def state_dict(self) -> dict:
        return {"recent_losses": list(self.recent_losses), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.recent_losses = deque(state["recent_losses"], maxlen=self.cfg.window)
        self.consecutive_skips = state["consecutive_skips"]
