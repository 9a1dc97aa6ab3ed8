"""What a study knows of its cells: how each ended, read from its run directory, and the runner's
own record (`study_state.json`, written whole after every cell).

A cell is done when its run directory says so, whatever the state file holds (a study stopped
between a cell's end and the next write of the state file does not run that cell again):

- finished: after its latest `run_start` the run ended (`run_end`) at its last step;
- diverged: after its latest `run_start` the trainer halted it (`halt`: the spike guard gave up,
  exit code 3). Training is deterministic, so a diverged cell would diverge again: it is not
  re-run either, and the report shows where it stopped.

Anything else (not started, interrupted, crashed: `failed` in the state file) runs on the next
invocation, from its newest checkpoint (`checkpoint.resume = "auto"`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trinity_train.files import atomic_write_json, read_json_object
from trinity_train.records import ENDED, HALTED, EventName, latest_start, named, run_status
from trinity_train.rundir import RunDir
from trinity_train.study.spec import StudyError

FINISHED, DIVERGED, FAILED, PENDING = "finished", "diverged", "failed", "pending"
DONE = (FINISHED, DIVERGED)


@dataclass(frozen=True)
class RunOutcome:
    status: str  # FINISHED or DIVERGED
    step: int | None  # optimizer steps applied when it ended
    iteration: int | None
    reason: str = ""  # why it halted


def run_outcome(run: RunDir, steps: int) -> RunOutcome | None:
    """How the run in `run` ended, if it is done (see the module doc); `steps` is its train.steps."""
    latest = latest_start(run.read_events())
    if latest is None:
        return None
    status = run_status(latest)
    if status == HALTED:
        halt = named(latest, EventName.HALT)[0]
        return RunOutcome(DIVERGED, halt.get("step"), halt.get("iter"), str(halt.get("reason", "")))
    ends = named(latest, EventName.RUN_END)
    if status == ENDED and isinstance(ends[-1].get("step"), int) and ends[-1]["step"] >= steps:
        return RunOutcome(FINISHED, ends[-1]["step"], ends[-1].get("iter"))
    return None


class StudyState:
    """`study_state.json`: per cell its `status`, `exit_code`, `attempts`, `wall_s` (all attempts
    together), `reason` (why it failed or diverged), `commits` (the code's commit of every attempt),
    `dirty` (whether any attempt ran on a tree with uncommitted changes), `config_sha256` (its
    config's hash, `cells.cell_hash`); per invocation its command, start, wall time
    and the machine's load average at its start and end."""

    def __init__(self, path):
        self.path = path
        data = read_json_object(path, StudyError, "study state") if path.is_file() else {}
        self.cells: dict[str, dict] = data.get("cells", {})
        self.invocations: list[dict] = data.get("invocations", [])

    def cell(self, name: str) -> dict:
        """A cell's entry; one written before the study recorded commits (a v1 study) reads with
        `commits` empty and `config_sha256` None: unknown, not a commit."""
        fresh = {"status": PENDING, "attempts": 0, "wall_s": 0.0, "exit_code": None, "reason": "", "commits": [],
                 "dirty": None, "config_sha256": None}
        return {**fresh, **self.cells.get(name, {})}

    def attempt(self, name: str, *, commit: str | None, dirty: bool | None, config_sha256: str | None) -> None:
        """Before an attempt trains: the code and the config it runs with (every commit any attempt
        ran at is kept, so a cell trained partly at another commit shows it, even one interrupted
        before its end was recorded)."""
        previous = self.cell(name)
        commits = list(previous["commits"])
        if commit is not None and commit not in commits:
            commits.append(commit)
        self.cells[name] = {**previous, "commits": commits, "dirty": previous["dirty"] or dirty,
                            "config_sha256": config_sha256 or previous["config_sha256"], "updated": time.time()}
        self.save()

    def record(self, name: str, status: str, *, exit_code: int | None, wall_s: float, reason: str = "",
               attempt: bool = True) -> None:
        previous = self.cell(name)
        self.cells[name] = {**previous, "status": status, "exit_code": exit_code, "reason": reason,
                            "attempts": previous["attempts"] + int(attempt),
                            "wall_s": previous["wall_s"] + wall_s, "updated": time.time()}
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, {"cells": self.cells, "invocations": self.invocations})
