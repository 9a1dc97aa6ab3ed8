"""The skip ledger: ranges of global batch indices never to train on.

The stability code adds a range when it rolls back over a loss spike; the config can list more
(`data.skip_ranges`). The train loader consults both and jumps over a range in one step, so
skipping costs nothing however long the range. The file (`<run.dir>/skip_ledger.json`) is
rewritten atomically on every save.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

from trinity_train.errors import DataError
from trinity_train.files import atomic_write_json

_LEDGER_VERSION = 1


@dataclass(frozen=True)
class SkipRange:
    start: int  # first global batch index skipped
    end: int  # one past the last
    reason: str = ""


class SkipLedger:
    def __init__(self, path: Path | None = None, ranges: list[SkipRange] | None = None):
        self.path = Path(path) if path is not None else None
        self._ranges: list[SkipRange] = []
        self._merged: list[tuple[int, int]] = []  # disjoint, sorted: what `contains` searches
        for r in ranges or []:
            self.add(r.start, r.end, r.reason)

    @classmethod
    def load(cls, path: str | Path) -> "SkipLedger":
        """The ledger stored at `path`; an empty one (saved there later) when the file is absent."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            table = json.loads(path.read_text())
            ranges = [SkipRange(int(r["start"]), int(r["end"]), str(r.get("reason", "")))
                      for r in table["ranges"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"skip ledger '{path}' is unreadable ({e}); fix or delete it") from None
        return cls(path, ranges)

    @classmethod
    def from_ranges(cls, ranges: list[list[int]], reason: str) -> "SkipLedger":
        """An in-memory ledger, e.g. for `data.skip_ranges`."""
        return cls(None, [SkipRange(a, b, reason) for a, b in ranges])

    @property
    def ranges(self) -> list[SkipRange]:
        return list(self._ranges)

    def add(self, start: int, end: int, reason: str = "") -> None:
        if not (0 <= start < end):
            raise ValueError(f"a skip range needs 0 <= start < end, got [{start}, {end})")
        self._ranges.append(SkipRange(int(start), int(end), reason))
        self._merged = _merge([(r.start, r.end) for r in self._ranges])

    def contains(self, index: int) -> bool:
        return self.next_allowed(index) != index

    def next_allowed(self, index: int) -> int:
        """The first global batch index >= `index` that no range covers."""
        i = bisect.bisect_right(self._merged, (index, float("inf"))) - 1
        if i >= 0 and self._merged[i][0] <= index < self._merged[i][1]:
            return self._merged[i][1]  # merged ranges are disjoint and not adjacent
        return index

    def save(self) -> None:
        if self.path is None:
            raise ValueError("this ledger has no file (it was built from the config)")
        atomic_write_json(self.path, {
            "version": _LEDGER_VERSION,
            "ranges": [{"start": r.start, "end": r.end, "reason": r.reason} for r in self._ranges],
        })


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
