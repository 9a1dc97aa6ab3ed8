"""What a run does about a step the guard refused (DESIGN §7): skip it, roll back, or halt, and
leave an incident report of each.

`Recovery` owns the streak of skips in a row, the skip ledger's entries for skips and rollbacks,
the incident reports, and the decision and bookkeeping of a rollback. It receives only what it
uses (this package sits below `train`): the run it may rewind (`Rewindable`: its counters, and
`rewind`, the one way in which it changes the run), the training loader (its position, the
documents of a batch and the datasets they come from), the checkpoints (`RollbackStore`) and the
drills (for the reports). Events and console notices go to the `recorder` each call is given
(`records.event` shapes, `notice(text)`).

Invariants: every skip is in the ledger (saved) before the iteration's incident report is
written; a rollback changes nothing but the trainer state `rewind` loads, the ledger, the LR
back-off and the checkpoints after its target, and keeps the iteration counter counting, so a
rolled-back run equals the run trained with those batches in the ledger from the start.
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

from trinity_train import signals
from trinity_train.config import Config
from trinity_train.data.ledger import LedgerKind, SkipLedger
from trinity_train.data.provenance import batch_documents
from trinity_train.records import EventName, IncidentAction, event, fields_of, incident_report
from trinity_train.rundir import RunDir
from trinity_train.stability.drills import FaultInjector
from trinity_train.stability.guard import TrainingDivergedError
from trinity_train.stability.incidents import signal_rows, write_incident
from trinity_train.stability.rollback import plan_rollback

# Train records kept for the incident reports (the signals before a skip).
INCIDENT_CONTEXT = 24


class RollbackStore(Protocol):
    """What a rollback needs of the run's checkpoints (`checkpoint.CheckpointManager`)."""

    def rollback_target(self, max_step: int, on_passed_over: Callable[[Path, str], None]) -> Path | None: ...

    def discard_after(self, step: int) -> list[Path]: ...


class Rewindable(Protocol):
    """The run a rollback rewinds (the Trainer)."""

    @property
    def iteration(self) -> int: ...  # global batches drawn so far, skipped ones included

    @property
    def step(self) -> int: ...  # optimizer steps applied

    def rewind(self, checkpoint: Path, lr_scale: float, ramp_steps: int) -> int:
        """Load every stateful component from `checkpoint` as a resume does, except the iteration
        counter (it keeps counting, so log lines stay unique) and the guard's windows (it judges on
        from what it saw before); then scale the learning rates by `lr_scale`, ramping back to 1
        over `ramp_steps` optimizer steps. Returns the iteration the checkpoint was taken at."""


class Recorder(Protocol):
    def event(self, event: dict) -> None: ...

    def notice(self, text: str) -> None: ...


class Recovery:
    def __init__(self, cfg: Config, rundir: RunDir, ledger: SkipLedger, *, run: Rewindable, loader: Any,
                 checkpoints: RollbackStore, faults: FaultInjector, is_main: bool):
        """`loader`: the training loader (its `position`, the documents of a batch and its
        `dataset_dirs`); `is_main`: this process writes the ledger and the reports."""
        self.cfg, self.rundir, self.ledger = cfg, rundir, ledger
        self.run, self.loader, self.checkpoints = run, loader, checkpoints
        self.faults, self.is_main = faults, is_main
        self.recent: deque[dict] = deque(maxlen=INCIDENT_CONTEXT)  # the last train records
        self.skip_streak: list[int] = []  # batch indices of the skips in a row so far

    @property
    def rollbacks(self) -> int:
        """Rollbacks of this run so far, resumes included (counted from the ledger)."""
        return len(self.ledger.rollbacks())

    def resumed(self) -> None:
        """After a resume: skips after the checkpoint are judged again, as the uninterrupted run
        judged them."""
        self.ledger.forget_skips_after(self.run.iteration)

    def start_events(self) -> list[dict]:
        """What a run starting with rollbacks asked for but impossible must say."""
        if self.cfg.stability.rollback_after <= 0 or self.cfg.checkpoint.every > 0:
            return []
        if self.is_main:
            print("warning: stability.rollback_after is set but checkpoint.every = 0: with no checkpoints "
                  "to go back to, spikes are only skipped", file=sys.stderr)
        return [event(EventName.ROLLBACK_UNAVAILABLE, iter=self.run.iteration, step=self.run.step,
                      reason="checkpoint.every = 0")]

    def after_step(self, result: Any, record: dict, batch_index: int, recorder: Recorder) -> None:
        """Follow every step (`result`: its `step.StepResult`, `record`: its train record); a
        skipped one goes into the ledger with its event and notice."""
        if result.verdict.apply:
            self.skip_streak.clear()
        else:
            self.skip_streak.append(batch_index)
            self._record_skip(result, batch_index, recorder)
        self.recent.append(record)

    def respond(self, result: Any, batch_index: int, recorder: Recorder) -> dict | None:
        """After a skipped step: roll back if the guard asks for it, and write the iteration's
        incident report; returns the rollback event, or None when the step was only skipped.
        Raises TrainingDivergedError (after writing a `halt` report) when the guard halts the run
        (too many skips in a row) or the rollbacks are spent."""
        rollback, streak, step = None, list(self.skip_streak), self.run.step
        if result.verdict.halt:
            self._report_incident(result, batch_index, step, IncidentAction.HALT, streak)
            raise TrainingDivergedError(result.verdict.halt)
        if result.verdict.rollback:
            try:
                rollback = self._roll_back(result, batch_index, recorder)
            except TrainingDivergedError:
                self._report_incident(result, batch_index, step, IncidentAction.HALT, streak)
                raise
        if rollback is not None:
            self.skip_streak.clear()
        self._report_incident(result, batch_index, step, IncidentAction.ROLLBACK if rollback else IncidentAction.SKIP,
                              streak if rollback else [batch_index], rollback)
        return rollback

    def _save_ledger(self) -> None:
        if self.is_main:
            self.ledger.save()

    def _record_skip(self, result: Any, batch_index: int, recorder: Recorder) -> None:
        verdict, iteration = result.verdict, self.run.iteration
        self.ledger.add(batch_index, batch_index + 1, reason=f"skipped step: {verdict.reason}", kind=LedgerKind.SKIP,
                        iteration=iteration)
        self._save_ledger()
        report = self.rundir.incident(iteration)
        recorder.event(event(EventName.SKIP, iter=iteration, step=self.run.step, batch=batch_index,
                             reason=verdict.reason, **signals.fields(result.signals, verdict.zscores),
                             incident=str(report.relative_to(self.rundir.path))))
        z = max((v for v in verdict.zscores.values() if v is not None), default=None)
        values = ", ".join(f"{s.label} {result.signals[s.name]:{s.notice_fmt}}" for s in signals.SIGNALS)
        recorder.notice(f"iteration {iteration}: step skipped ({verdict.reason}"
                        f"{f', z {z:.1f}' if z is not None else ''}; {values}); report {report}")

    def _report_incident(self, result: Any, batch_index: int, step: int, action: IncidentAction,
                         batches: list[int], rollback: dict | None = None) -> None:
        """Write the incident report of this iteration, which found `step` optimizer steps applied
        (main process only)."""
        if not self.is_main:
            return
        iteration = self.run.iteration
        report = incident_report(
            iter=iteration, step=step, action=action, reason=result.verdict.reason,
            onset_iter=result.verdict.onset_iter, signals=signal_rows(list(self.recent)),
            layer_grad_norms=result.layer_grad_norms,
            batches=[{"index": b, "documents": batch_documents(self.loader, b)} for b in batches],
            drill=self.faults.events(iteration, batch_index), lr=result.lrs,
            rollback=rollback and fields_of(rollback))
        write_incident(self.rundir, report)

    def _roll_back(self, result: Any, last_bad_batch: int, recorder: Recorder) -> dict | None:
        """Restore a checkpoint from before the incident's onset and never train on the batches
        drawn since it (nor on `skip_extra_batches` after the trigger); returns the rollback event,
        or None when there is no checkpoint to go back to.

        Everything stateful comes back (weights, optimizer, schedule, loader position, guard,
        RNG), as on a resume, but for what `Rewindable.rewind` keeps.
        """
        cfg, verdict, run = self.cfg.stability, result.verdict, self.run
        iteration, from_step = run.iteration, run.step
        if self.cfg.checkpoint.every <= 0:
            recorder.event(event(EventName.ROLLBACK_UNAVAILABLE, iter=iteration, step=from_step,
                                 reason="checkpoint.every = 0"))
            return None
        plan = plan_rollback(cfg, self.ledger.rollbacks(), verdict.onset_iter, verdict.onset_step, iteration)

        def passed_over(path: Path, why: str) -> None:
            recorder.event(event(EventName.CHECKPOINT_PASSED_OVER, path=str(path), reason=why))
        target = self.checkpoints.rollback_target(plan.max_target_step, on_passed_over=passed_over)
        # An incident opened long ago by a mild excursion can reach back past every checkpoint kept;
        # then go back to before this streak of skips (retention keeps that checkpoint).
        streak_target = from_step - cfg.rollback_lookback
        if target is None and plan.repeat == 0 and streak_target > plan.max_target_step:
            target = self.checkpoints.rollback_target(streak_target, on_passed_over=passed_over)
            if target is not None:
                recorder.notice(f"iteration {iteration}: no checkpoint kept from before the incident's onset "
                                f"(iteration {verdict.onset_iter}); rolling back to before this streak of skips")
        if target is None:
            recorder.event(event(EventName.ROLLBACK_UNAVAILABLE, iter=iteration, step=from_step,
                                 reason=f"no sound checkpoint at or before step {plan.max_target_step}"))
            return None
        restored_iter = run.rewind(target, plan.lr_scale, cfg.lr_backoff_steps)
        to_step, first_bad = run.step, self.loader.position
        skipped = [first_bad, last_bad_batch + 1 + plan.extra_batches]
        self.ledger.add(*skipped, reason=f"rollback to step {to_step}", kind=LedgerKind.ROLLBACK,
                        iteration=iteration, target_step=to_step, extra_batches=plan.extra_batches,
                        repeat=plan.repeat, onset_iter=verdict.onset_iter)
        self._save_ledger()
        # Checkpoints after the target hold the timeline that was just undone: never resume from them.
        discarded = self.checkpoints.discard_after(to_step)
        rolled_back = event(EventName.ROLLBACK, iter=iteration, from_step=from_step, to_step=to_step,
                            to_iter=restored_iter, checkpoint=str(target), skipped_batches=skipped,
                            rollbacks=self.rollbacks, onset_iter=verdict.onset_iter, repeat=plan.repeat,
                            lr_scale=plan.lr_scale, discarded_checkpoints=[str(p) for p in discarded],
                            incident=str(self.rundir.incident(iteration).relative_to(self.rundir.path)))
        recorder.event(rolled_back)
        recorder.notice(f"iteration {iteration}: rolled back from step {from_step} to step {to_step} "
                        f"({target.name}); batches {skipped[0]}-{skipped[1] - 1} will not be trained on"
                        + (f"; learning rate x{plan.lr_scale:g}" if plan.lr_scale < 1.0 else ""))
        if plan.lr_scale < 1.0:
            recorder.event(event(EventName.LR_BACKOFF, iter=iteration, scale=plan.lr_scale,
                                 ramp_steps=cfg.lr_backoff_steps))
        return rolled_back
