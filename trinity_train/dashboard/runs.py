"""One run directory as the dashboard sees it: its records as columns, its events, and which
iterations were abandoned.

Iterations are abandoned two ways (docs/CONTRACT.md "Run directory"): a `rollback` event undid
iterations `to_iter+1 .. iter` (their records stay in metrics.jsonl), and a resume moved the
records it went back past into metrics.superseded.jsonl. Both are drawn faded; everything else is
the run's main line.

`refresh()` reads what the trainer appended since the last call (a worker thread calls it); the
query side reads under the same lock, taking views of the arrays, which later appends do not
change.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trinity_train.columnar import read_mirror
from trinity_train.dashboard.columns import MetricsColumns
from trinity_train.dashboard.tail import FileTail
from trinity_train.records import EventName, named, run_status
from trinity_train.rundir import RunDir, incident_iteration


def _no_constant(name: str) -> None:
    """NaN and Infinity (not JSON, but Python writes them) become null."""
    return None


@dataclass
class Update:
    """What one refresh of a run found."""

    run: int
    generation: int                  # bumped whenever what was read before became void
    reset: bool                      # a file was rewritten, truncated or deleted
    new: dict[str, int] = field(default_factory=dict)  # records/events that arrived, by kind
    last_iter: int | None = None

    def as_message(self) -> dict:
        return {"run": self.run, "generation": self.generation, "reset": self.reset, "new": self.new,
                "last_iter": self.last_iter}


class RunView:
    def __init__(self, index: int, path: str | Path):
        self.index = index
        self.rundir = RunDir(path)
        self.name = Path(path).resolve().name or str(path)
        self.lock = threading.Lock()
        self.generation = 0
        self.loaded = False          # the first refresh has read everything there was
        self._tails = {"metrics": FileTail(self.rundir.metrics), "superseded": FileTail(self.rundir.superseded),
                       "events": FileTail(self.rundir.events)}
        self.metrics = MetricsColumns()
        self.superseded = MetricsColumns()
        self.events: list[dict] = []
        # What a view worked out from this run's files: name -> (the files' state it was worked
        # out for, the value), so a page polling a long run does not recompute it for nothing.
        self.derived: dict[str, tuple[object, object]] = {}

    # -- reading the files ---------------------------------------------------------------------

    def _load_mirror(self) -> dict[str, int]:
        """Before metrics.jsonl is read from its start: take what the trainer's columnar mirror of
        it holds (milliseconds for a million lines), so only the lines after it are parsed."""
        mirrored = read_mirror(self.rundir.metrics_mirror, self.rundir.metrics)
        if mirrored is None:
            return {}
        table, end, identity = mirrored
        parsed = MetricsColumns()
        counts = parsed.append_table(table)
        if not self._tails["metrics"].start_at(end, identity):
            return {}
        with self.lock:
            return self._append("metrics", (parsed, counts))

    def refresh(self) -> Update | None:
        """Read what changed; None when nothing did."""
        reset, new = False, {}
        for name, tail in self._tails.items():
            if name == "metrics" and tail.offset == 0:
                new.update(self._load_mirror())
            poll = tail.poll()
            if poll.reset:
                reset = True
                with self.lock:
                    self._clear(name)
            for chunk in poll.chunks:  # parsed outside the lock: the slow part
                parsed = self._parse(name, chunk)
                with self.lock:
                    counts = self._append(name, parsed)
                for kind, n in counts.items():
                    new[kind] = new.get(kind, 0) + n
        first = not self.loaded
        self.loaded = True
        if reset:
            self.generation += 1
        new = {k: n for k, n in new.items() if n}
        if not (reset or new or first):
            return None
        return Update(self.index, self.generation, reset, new, self.last_iter())

    def _clear(self, name: str) -> None:
        if name == "events":
            self.events = []
        else:
            setattr(self, name, MetricsColumns())

    @staticmethod
    def _parse(name: str, chunk: bytes):
        if name != "events":
            parsed = MetricsColumns()
            counts = parsed.append_lines(chunk)
            return parsed, counts
        events = []
        for line in chunk.splitlines():
            try:
                event = json.loads(line, parse_constant=_no_constant)
            except ValueError:
                continue  # a garbled line
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                events.append(event)
        return events, {"events": len(events)}

    def _append(self, name: str, parsed) -> dict[str, int]:
        value, counts = parsed
        if name == "events":
            self.events.extend(value)
            return counts
        target: MetricsColumns = getattr(self, name)
        for kind in MetricsColumns.KINDS:
            source = getattr(value, kind)
            for column, array in source.columns.items():
                target_kind = getattr(target, kind)
                target_kind.columns[column].append(array.values)
        if value.moe_layers:
            target.moe_layers = value.moe_layers
        if name == "superseded":
            return {"superseded": sum(counts.values())}
        return counts

    # -- what the views need -------------------------------------------------------------------

    def exists(self) -> bool:
        return self.rundir.path.is_dir()

    def last_iter(self) -> int | None:
        iters = self.metrics.train["iter"]
        return int(iters[-1]) if len(iters) else None

    def events_named(self, *names: EventName) -> list[dict]:
        return named(self.events, *names)

    def rollback_ranges(self) -> np.ndarray:
        """[k, 2] inclusive iteration ranges that rollbacks undid (to_iter+1 .. iter)."""
        ranges = [(int(e["to_iter"]) + 1, int(e["iter"])) for e in self.events_named(EventName.ROLLBACK)
                  if isinstance(e.get("to_iter"), int) and isinstance(e.get("iter"), int)]
        return np.array(sorted(ranges), np.int64).reshape(-1, 2)

    def abandoned_mask(self, iters: np.ndarray) -> np.ndarray:
        """True for the iterations a rollback undid."""
        ranges = self.rollback_ranges()
        if not len(ranges) or not len(iters):
            return np.zeros(len(iters), bool)
        # running maximum of the range ends, so overlapping or nested ranges count as one
        ends = np.maximum.accumulate(ranges[:, 1])
        at = np.searchsorted(ranges[:, 0], iters, "right") - 1
        return (at >= 0) & (iters <= ends[np.maximum(at, 0)])

    def incident_report(self, name: str) -> dict | None:
        """The incident report `name` (`XXXXXXXX.json`, or the bare iteration), or None: for a
        name of any other form, a missing or unreadable file, and a file that resolves outside
        the run directory (a symlink pointing elsewhere)."""
        iteration = incident_iteration(name, canonical=False)
        if iteration is None:
            return None
        path = self.rundir.incident(iteration)
        try:
            real = path.resolve(strict=True)
            inside = real.is_relative_to(self.rundir.path.resolve(strict=True)) and real.is_file()
            report = json.loads(real.read_text(encoding="utf-8"), parse_constant=_no_constant) if inside else None
        except (OSError, RuntimeError, ValueError):
            return None
        return report if isinstance(report, dict) else None

    def state(self) -> str:
        """waiting (nothing written yet), running, ended or halted."""
        if not self.exists() or (not len(self.metrics.train) and not self.events):
            return "waiting"
        return run_status(self.events)
