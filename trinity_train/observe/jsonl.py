"""Append-only JSON-lines files (`metrics.jsonl`, `events.jsonl`): one object per line.

Every line is flushed as soon as it is written, so a crash loses at most the line being written;
readers (`trinity_train.files.read_jsonl`) skip a torn last line. Non-finite floats are written as
null (JSON has no NaN).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from trinity_train.files import atomic_open, json_safe, read_jsonl


def move_records(source: Path, target: Path, move: Callable[[dict], bool], mark: dict) -> int:
    """Append the records of `source` that `move` accepts to `target` (each updated with `mark`),
    then rewrite `source` without them (temporary file, then rename), and without a torn last line
    that the next append would otherwise run into. Returns how many moved."""
    source = Path(source)
    if not source.is_file():
        return 0
    records = read_jsonl(source)
    moved = [r for r in records if move(r)]
    if moved:
        with open(target, "a", encoding="utf-8") as f:  # first, so a crash loses nothing
            for record in moved:
                f.write(json.dumps({**record, **mark}, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
    with atomic_open(source) as f:
        for record in records:
            if not move(record):
                f.write(json.dumps(record, allow_nan=False) + "\n")
    return len(moved)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        if self._file.tell() and not _ends_with_newline(self.path):
            self._file.write(b"\n")  # a killed writer's torn line must not swallow the next one
            self._file.flush()

    def write(self, record: dict) -> int:
        """Append one line; returns the file's length after it (where the line ends)."""
        self._file.write((json.dumps(json_safe(record), allow_nan=False) + "\n").encode())
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
