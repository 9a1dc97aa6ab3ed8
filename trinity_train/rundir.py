"""The one place that names a run directory's files (`run.dir`, DESIGN §6).

Everything about a run lives under its directory; the trainer writes it, and the CLI's
`incidents`, the dashboard, the report and the ablation study read it, all through `RunDir`:

| name                        | what                                                              |
|-----------------------------|-------------------------------------------------------------------|
| `config.toml`               | the resolved config of the latest start                           |
| `metrics.jsonl`             | one JSON object per iteration / validation / layer-statistics step |
| `metrics.columns.arrow`     | the plotted fields of metrics.jsonl as Arrow columns (a cache)    |
| `metrics.superseded.jsonl`  | records a resume discarded (the run went back past them)          |
| `events.jsonl`              | what happened: start, resume, checkpoint, skip, rollback, ...     |
| `timeline.jsonl`            | where the time of every attempt went (goodput), appended          |
| `hangs/`                    | every thread's stack of a rank the watchdog found hung            |
| `skip_ledger.json`          | global batches never to train on again                            |
| `checkpoints/step_XXXXXXXX/`| DCP checkpoints                                                   |
| `checkpoints/abandoned/`    | checkpoints of a future a resume left behind (checkpoint/layout)  |
| `incidents/XXXXXXXX.json`   | one report per skipped step or rollback, named by its iteration   |
| `tb/`, `wandb/`             | TensorBoard and W&B files                                         |
| `.lock`                     | held (flock) by the live run; names its host, pid and start time  |
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from trinity_train.errors import ArgumentError, ConfigError
from trinity_train.files import append_line, json_safe, read_jsonl

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
METRICS_MIRROR_FILE = "metrics.columns.arrow"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
EVENTS_FILE = "events.jsonl"
TIMELINE_FILE = "timeline.jsonl"
HANGS_DIR = "hangs"
LEDGER_FILE = "skip_ledger.json"
CHECKPOINTS_DIR = "checkpoints"
INCIDENTS_DIR = "incidents"
TENSORBOARD_DIR = "tb"
WANDB_DIR = "wandb"
LOCK_FILE = ".lock"

_INCIDENT_NAME = re.compile(r"([0-9]{1,12})(?:\.json)?")


def incident_file_name(iteration: int) -> str:
    """The file name of the incident report of `iteration` (8 digits, more past 10^8)."""
    return f"{iteration:08d}.json"


def incident_iteration(name: str, canonical: bool = True) -> int | None:
    """The iteration an incident report's file name names, or None for a name of another form;
    `canonical=False` also takes the bare iteration and fewer digits (a name a person typed)."""
    match = _INCIDENT_NAME.fullmatch(name)
    if not match:
        return None
    iteration = int(match.group(1))
    return iteration if not canonical or name == incident_file_name(iteration) else None


def incident_name(path: str | Path) -> str:
    """The file name of an incident report given by its path, as an event holds it (relative to
    the run directory, written on any system)."""
    return str(path).replace("\\", "/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def metrics_mirror(self) -> Path:
        return self.path / METRICS_MIRROR_FILE

    @property
    def superseded(self) -> Path:
        return self.path / SUPERSEDED_FILE

    @property
    def events(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def timeline(self) -> Path:
        return self.path / TIMELINE_FILE

    @property
    def hangs(self) -> Path:
        return self.path / HANGS_DIR

    @property
    def ledger(self) -> Path:
        return self.path / LEDGER_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def incidents(self) -> Path:
        return self.path / INCIDENTS_DIR

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD_DIR

    @property
    def wandb(self) -> Path:
        return self.path / WANDB_DIR

    def required(self) -> RunDir:
        """This run directory, named by a RUN_DIR argument; ArgumentError (exit 2) when it is not one."""
        if (problem := self.not_a_run()) is not None:
            raise ArgumentError(f"RUN_DIR {problem}: pass the run's directory (its run.dir)")
        return self

    def not_a_run(self) -> str | None:
        """Why the path is not a run directory to read ('does not exist', 'is a file', a plain
        directory), or None when it is one: it holds what a run's start writes."""
        if not self.path.exists():
            return f"'{self.path}' does not exist"
        if not self.path.is_dir():
            return f"'{self.path}' is a file, not a run directory"
        if not any(p.is_file() for p in (self.config, self.events, self.metrics)):
            return (f"'{self.path}' is not a run directory (it holds none of {CONFIG_FILE}, {EVENTS_FILE}, "
                    f"{METRICS_FILE})")
        return None

    @property
    def lock(self) -> Path:
        """Locked by the run that owns the directory (runlock.py)."""
        return self.path / LOCK_FILE

    def require_writable(self) -> None:
        """ConfigError (naming run.dir and what to do) unless the run directory is, or can be
        created as, a directory this process can write; checked before any work so that a run
        never starts where its files cannot go."""
        existing = self.path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == self.path and not self.path.is_dir():
            raise ConfigError(f"run.dir: '{self.path}' is a file, not a directory; choose another --run.dir")
        if not existing.is_dir():
            raise ConfigError(f"run.dir: '{self.path}' cannot be created: '{existing}' is a file; "
                              "choose another --run.dir")
        for directory in (existing, self.checkpoints):
            if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
                raise ConfigError(f"run.dir: '{directory}' cannot be written (a read-only file system or no "
                                  "permission); choose another --run.dir, or make it writable")

    def hang_stacks(self, rank: int, iteration: int) -> Path:
        """Where the watchdog writes every thread's stack of `rank`, hung at `iteration` (a later
        hang of the same rank and iteration, in another attempt, gets `-2`, `-3`, ...)."""
        path = self.hangs / f"rank{rank:05d}-iter{iteration:08d}.txt"
        n = 1
        while path.exists():
            n += 1
            path = self.hangs / f"rank{rank:05d}-iter{iteration:08d}-{n}.txt"
        return path

    def append_event(self, built: dict) -> None:
        """Append one event (built by `records.event`) to events.jsonl, stamped with the time as the
        recorder stamps its own, as one whole line: from any rank (the watchdog, a drill acting on
        a rank that does not write the run's records), while rank 0's recorder appends too."""
        self.path.mkdir(parents=True, exist_ok=True)
        line = {"event": built["event"], "time": time.time(), **{k: v for k, v in built.items() if k != "event"}}
        append_line(self.events, json.dumps(json_safe(line), allow_nan=False))

    def incident(self, iteration: int) -> Path:
        """The report of the incident at `iteration`."""
        return self.incidents / incident_file_name(iteration)

    def incident_files(self) -> list[tuple[int, Path]]:
        """(iteration, report file) of every incident report, in iteration order."""
        if not self.incidents.is_dir():
            return []
        found = [(n, p) for p in self.incidents.iterdir()
                 if (n := incident_iteration(p.name)) is not None and p.is_file()]
        return sorted(found)

    def read_metrics(self, kind: str | None = None) -> list[dict]:
        """The complete records of metrics.jsonl, optionally only those of one `kind` (a
        `records.RecordKind`)."""
        records = read_jsonl(self.metrics)
        return records if kind is None else [r for r in records if r.get("kind") == kind]

    def read_events(self, name: str | None = None) -> list[dict]:
        events = read_jsonl(self.events)
        return events if name is None else [e for e in events if e.get("event") == name]
