"""The goodput account of a run, from its `timeline.jsonl` (docs/CONTRACT.md).

Every second between the first attempt's process start and the run's last record falls in one
category:

- `startup`: process start to the loop (imports, data, model build, checkpoint load);
- `productive`: steps whose work survives — not skipped, not undone later;
- `undone`: steps a later rollback or restart went back past (their work was redone);
- `skipped`: steps the guard refused, that nothing undid;
- `checkpoint`: the blocking part of checkpoint saves;
- `rollback`: restoring a checkpoint to roll back;
- `validation`, `statistics` (gathering the ranks' statistics), `data` (waiting for batches);
- `shutdown`: the end of an attempt (the last save's wait, closing the records);
- `lost`: to failures — the iteration a failure interrupted, what a failed attempt did after its
  last record, the failure's detection and the restart up to the next attempt's process start.

A step's time is its iteration's less the phases inside it that have their own category (a
validation or a save after a step is not step time). An attempt's records are contiguous, so the
categories add up to the wall time up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trinity_train.files import read_jsonl
from trinity_train.records import Phase, TimelineKind
from trinity_train.rundir import RunDir

CATEGORIES = ("startup", "productive", "undone", "skipped", "checkpoint", "rollback", "validation",
              "statistics", "data", "shutdown", "lost")
# The phases inside an iteration that are not step time.
_PHASE_CATEGORY = {Phase.DATA: "data", Phase.VALIDATION: "validation", Phase.CHECKPOINT_SAVE: "checkpoint",
                   Phase.CHECKPOINT_LOAD: "rollback", Phase.STATISTICS: "statistics"}
# A phase outside any iteration.
_SPAN_CATEGORY = {**_PHASE_CATEGORY, Phase.CHECKPOINT_LOAD: "startup", Phase.SHUTDOWN: "shutdown"}


def _zero() -> dict[str, float]:
    return dict.fromkeys(CATEGORIES, 0.0)


@dataclass
class Attempt:
    """One attempt: a process that started the loop (its host, pid, where it began)."""

    index: int
    host: str
    pid: int
    process_start: float  # when it began: its process started (or the previous attempt of its process ended)
    start_iter: int
    devices: int
    end: float  # its last record's end
    status: str | None  # its `end` record's status; None when it was killed
    seconds: dict[str, float] = field(default_factory=_zero)
    lost_before: float = 0.0  # from the previous attempt's last record to this one's start (in `lost`)
    steps: dict[str, int] = field(default_factory=lambda: {"productive": 0, "undone": 0, "skipped": 0})

    @property
    def wall(self) -> float:
        """From its start to its last record (its categories are this and `lost_before`)."""
        return self.end - self.process_start

    def to_dict(self) -> dict:
        return {"attempt": self.index, "host": self.host, "pid": self.pid, "process_start": self.process_start,
                "start_iter": self.start_iter, "devices": self.devices, "end": self.end, "status": self.status,
                "wall_s": self.wall, "lost_before_s": self.lost_before, "seconds": dict(self.seconds),
                "steps": dict(self.steps)}


@dataclass
class GoodputAccount:
    attempts: list[Attempt]
    seconds: dict[str, float]  # the whole run, by category
    steps: dict[str, int]  # iterations by what became of them
    wall: float  # first process start to the last record

    @property
    def goodput(self) -> float:
        """The fraction of the wall time that went into steps whose work survives."""
        return self.seconds["productive"] / self.wall if self.wall > 0 else 0.0

    @property
    def accounted(self) -> float:
        return sum(self.seconds.values())

    def to_dict(self) -> dict:
        return {"wall_s": self.wall, "goodput": self.goodput, "seconds": dict(self.seconds), "steps": dict(self.steps),
                "attempts": [a.to_dict() for a in self.attempts]}


@dataclass
class _Step:
    """An iteration's step time, until the run's later history decides what became of it."""

    iter: int
    seconds: float
    skipped: bool
    attempt: Attempt
    undone: bool = False


def _undo_after(steps: list[_Step], iteration: int) -> None:
    for step in steps:
        if step.iter > iteration:
            step.undone = True


def account(run_dir: str | Path) -> GoodputAccount | None:
    """The run's account, or None when it has no timeline (a run from before it, or not started)."""
    records = read_jsonl(RunDir(run_dir).timeline)
    attempts: list[Attempt] = []
    steps: list[_Step] = []
    for record in records:
        kind = record.get("kind")
        if kind == TimelineKind.ATTEMPT:
            # An attempt begins when its process started, or where the previous one ended when
            # one process ran both (a program that trains twice).
            began = record["process_start"]
            if attempts:
                began = max(began, attempts[-1].end)
            attempt = Attempt(len(attempts), record["host"], record["pid"], began, record["iter"], record["devices"],
                              end=record["start"], status=None)
            if attempts:  # what a failed attempt did after its last record, and the restart
                attempt.lost_before = began - attempts[-1].end
                attempt.seconds["lost"] = attempt.lost_before
            attempt.seconds["startup"] = record["start"] - began
            attempts.append(attempt)
            _undo_after(steps, record["iter"])  # a resume goes back to its checkpoint
        elif not attempts:
            continue  # a torn beginning: nothing to attribute it to
        elif kind == TimelineKind.ITERATION and record.get("failed"):
            attempt = attempts[-1]  # its step never completed: lost, like the restart after it
            attempt.seconds["lost"] += record["end"] - record["start"]
            attempt.end = record["end"]
        elif kind == TimelineKind.ITERATION:
            attempt = attempts[-1]
            phases = record["phases"]
            for phase, seconds in phases.items():
                if phase in _PHASE_CATEGORY:
                    attempt.seconds[_PHASE_CATEGORY[phase]] += seconds
            step_seconds = (record["end"] - record["start"]) - sum(
                seconds for phase, seconds in phases.items() if phase in _PHASE_CATEGORY)
            steps.append(_Step(record["iter"], step_seconds, record["skipped"], attempt))
            if record.get("rollback_to_iter") is not None:
                _undo_after(steps, record["rollback_to_iter"])
            attempt.end = record["end"]
        elif kind == TimelineKind.SPAN:
            attempt = attempts[-1]
            attempt.seconds[_SPAN_CATEGORY.get(record["phase"], "shutdown")] += record["end"] - record["start"]
            attempt.end = record["end"]
        elif kind == TimelineKind.END:
            attempt = attempts[-1]
            attempt.seconds["shutdown"] += record["end"] - attempt.end
            attempt.end, attempt.status = record["end"], record["status"]
    for step in steps:
        what = "undone" if step.undone else "skipped" if step.skipped else "productive"
        step.attempt.seconds[what] += step.seconds
        step.attempt.steps[what] += 1
    if not attempts:
        return None
    total, counts = _zero(), {"productive": 0, "undone": 0, "skipped": 0}
    for attempt in attempts:
        for name in CATEGORIES:
            total[name] += attempt.seconds[name]
        for name in counts:
            counts[name] += attempt.steps[name]
    return GoodputAccount(attempts, total, counts, wall=attempts[-1].end - attempts[0].process_start)
