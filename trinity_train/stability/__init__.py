"""Training stability (DESIGN §7): the step guard (detector and verdicts), the rollback policy and
the LR back-off, fault drills, and incident reports."""

from trinity_train.stability.guard import HALT_EXIT_CODE, StepGuard, TrainingDivergedError, Verdict

__all__ = ["HALT_EXIT_CODE", "StepGuard", "TrainingDivergedError", "Verdict"]
