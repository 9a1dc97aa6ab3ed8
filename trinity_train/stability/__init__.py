"""Training stability: skip steps whose loss or gradient is non-finite or spikes."""

from trinity_train.stability.guard import StepGuard, TrainingDivergedError, Verdict

__all__ = ["StepGuard", "TrainingDivergedError", "Verdict"]
