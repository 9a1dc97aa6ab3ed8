"""Append-only JSON-lines files (`metrics.jsonl`, `events.jsonl`): one object per line.

Every line is flushed as soon as it is written, so a crash loses at most the line being written;
readers skip a torn last line. Non-finite floats are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def read_jsonl(path: Path) -> list[dict]:
    """Every complete record in `path` (a torn or garbled line is skipped)."""
    records = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def keep_records(path: Path, keep: Callable[[dict], bool]) -> None:
    """Rewrite `path` with only the records `keep` accepts (temp file, then rename)."""
    path = Path(path)
    if not path.is_file():
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for record in read_jsonl(path):
            if keep(record):
                f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
