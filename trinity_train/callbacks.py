"""The training loop's callback interface (DESIGN §2): what happens around each iteration, told
to whoever attached, so a feature joins the loop without editing it.

`Trainer(cfg, callbacks=[...])` or `trainer.add_callback(cb)` attaches a `TrainerCallback`; the
trainer calls its built-in callbacks first (the records writer, the fault drills), then the
attached ones, in order. Every method is a no-op here: override the ones you need.

What a callback may read of the trainer: `trainer.cfg`, `trainer.state` (iteration, step,
tokens_seen: already advanced for the iteration being reported), `trainer.recorder` (the run's
event/record sink, from `on_start` on), `trainer.summary`, `trainer.model`, `trainer.checkpoints`.
A callback that raises stops the run as that exception (a test's simulated crash); nothing here
catches it. This module imports nothing of the package, so every layer can implement it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TrainerCallback:
    """Hooks of the training loop; the trainer passes itself first (`trainer`: a `train.Trainer`)."""

    def phase_begin(self, trainer: Any, phase: str) -> None:
        """The rank enters `phase` (a `records.Phase`: data, step, validation, checkpoint_save,
        checkpoint_load, statistics, shutdown); phases do not nest. A rollback's restore is a
        checkpoint_load after the step that asked for it."""

    def phase_end(self, trainer: Any, phase: str, seconds: float) -> None:
        """The rank leaves `phase` after `seconds` (wall clock), also when it raised."""

    def on_start(self, trainer: Any) -> None:
        """The run is restored (or fresh), its start events are recorded; no batch drawn yet."""

    def before_step(self, trainer: Any, batch: Any) -> None:
        """Batch `batch` was drawn as iteration `trainer.state.iteration`; the step has not run.
        The batch may be changed in place (a poisoned batch)."""

    def after_step(self, trainer: Any, result: Any, record: dict) -> None:
        """The step ran: `result` is its `step.StepResult`, `record` its `train` record; counters
        are advanced, a skip is in the ledger; validation and checkpointing are still to come."""

    def on_skip(self, trainer: Any, result: Any, batch_index: int) -> None:
        """The step on batch `batch_index` was skipped (after `after_step`), before the rollback
        it may ask for (`result.verdict.rollback`) looks for a checkpoint."""

    def on_rollback(self, trainer: Any, event: dict) -> None:
        """A rollback restored a checkpoint; `event` is the `rollback` event it recorded."""

    def after_checkpoint(self, trainer: Any, step: int, iteration: int, path: Path) -> None:
        """The checkpoint of `step` (taken at `iteration`) is committed at `path` (an asynchronous
        one: at a later iteration)."""

    def after_iteration(self, trainer: Any) -> None:
        """The iteration is complete: validated and checkpointed when due, or rolled back (an
        asynchronous save may still be in flight). The place to stop a run between iterations."""

    def on_halt(self, trainer: Any, error: Exception) -> None:
        """The run stops as diverged (`stability.TrainingDivergedError`); `on_end` follows."""

    def on_end(self, trainer: Any, summary: Any) -> None:
        """The run ends, however it ends (finished, halted, crashed); `summary` is final."""


class CallbackList(TrainerCallback):
    """Callbacks called in order, as one."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks = list(callbacks or [])

    def add(self, callback: TrainerCallback) -> None:
        self.callbacks.append(callback)

    def _each(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def phase_begin(self, trainer, phase):
        self._each("phase_begin", trainer, phase)

    def phase_end(self, trainer, phase, seconds):
        self._each("phase_end", trainer, phase, seconds)

    def on_start(self, trainer):
        self._each("on_start", trainer)

    def before_step(self, trainer, batch):
        self._each("before_step", trainer, batch)

    def after_step(self, trainer, result, record):
        self._each("after_step", trainer, result, record)

    def on_skip(self, trainer, result, batch_index):
        self._each("on_skip", trainer, result, batch_index)

    def on_rollback(self, trainer, event):
        self._each("on_rollback", trainer, event)

    def after_checkpoint(self, trainer, step, iteration, path):
        self._each("after_checkpoint", trainer, step, iteration, path)

    def after_iteration(self, trainer):
        self._each("after_iteration", trainer)

    def on_halt(self, trainer, error):
        self._each("on_halt", trainer, error)

    def on_end(self, trainer, summary):
        self._each("on_end", trainer, summary)
