"""The skip ledger: ranges of global batch indices never to train on.

The stability code adds a range for every skipped step (kind `skip`) and for every rollback
(kind `rollback`: the batches from the restored checkpoint's position through the trigger and a
margin); the config can list more (`data.skip_ranges`). The train loader consults both and jumps
over a range in one step, so skipping costs nothing however long the range. The file
(`<run.dir>/skip_ledger.json`) is rewritten atomically on every save, and it outlives the
checkpoints: a rollback's ranges stay ruled out after any crash and resume, while a resume from a
checkpoint taken before a skip forgets that skip (`forget_skips_after`), so the resumed run draws
the batch again and judges it afresh, exactly as the uninterrupted run did.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from trinity_train.errors import DataError
from trinity_train.files import atomic_write_json, read_json_object

_LEDGER_VERSION = 2


class LedgerKind(StrEnum):
    """Why a range is in the ledger (its `kind`; the ledger's own vocabulary, not event names)."""

    SKIP = "skip"  # one skipped step
    ROLLBACK = "rollback"  # the batches a rollback ruled out
    CONFIG = "config"  # data.skip_ranges


KINDS = tuple(LedgerKind)


@dataclass(frozen=True)
class SkipRange:
    start: int  # first global batch index skipped
    end: int  # one past the last
    reason: str = ""
    kind: str = LedgerKind.SKIP
    iteration: int = 0  # the iteration at which it was added (0: unknown, e.g. the config's)
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # a rollback's plan


def _range_from_json(r: dict) -> SkipRange:
    reason = str(r.get("reason", ""))
    # Version 1 had no kind: its rollback ranges said so in their reason.
    kind = r.get("kind") or (LedgerKind.ROLLBACK if reason.startswith("rollback") else LedgerKind.SKIP)
    return SkipRange(int(r["start"]), int(r["end"]), reason, kind, int(r.get("iteration", 0)),
                     dict(r.get("details", {})))


class SkipLedger:
    def __init__(self, path: Path | None = None, ranges: list[SkipRange] | None = None):
        self.path = Path(path) if path is not None else None
        self._ranges: list[SkipRange] = []
        self._merged: list[tuple[int, int]] = []  # disjoint, sorted: what `contains` searches
        for r in ranges or []:
            self._append(r)

    @classmethod
    def load(cls, path: str | Path) -> "SkipLedger":
        """The ledger stored at `path`; an empty one (saved there later) when the file is absent."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        table = read_json_object(path, DataError, "skip ledger")
        try:
            ranges = [_range_from_json(r) for r in table["ranges"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"skip ledger '{path}' is unreadable ({type(e).__name__}: {e}); fix or delete it") from None
        return cls(path, ranges)

    @classmethod
    def from_ranges(cls, ranges: list[list[int]], reason: str) -> "SkipLedger":
        """An in-memory ledger, e.g. for `data.skip_ranges`."""
        return cls(None, [SkipRange(a, b, reason, kind=LedgerKind.CONFIG) for a, b in ranges])

    @property
    def ranges(self) -> list[SkipRange]:
        return list(self._ranges)

    def rollbacks(self) -> list[SkipRange]:
        """The ranges of rollbacks, oldest first."""
        return [r for r in self._ranges if r.kind == LedgerKind.ROLLBACK]

    def add(self, start: int, end: int, reason: str = "", kind: str = LedgerKind.SKIP, iteration: int = 0,
            **details: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown skip range kind {kind!r}")
        self._append(SkipRange(int(start), int(end), reason, kind, int(iteration), details))

    def _append(self, r: SkipRange) -> None:
        if not (0 <= r.start < r.end):
            raise ValueError(f"a skip range needs 0 <= start < end, got [{r.start}, {r.end})")
        self._ranges.append(r)
        self._remerge()

    def _remerge(self) -> None:
        self._merged = _merge([(r.start, r.end) for r in self._ranges])

    def forget_skips_after(self, iteration: int) -> int:
        """Drop the single-step skips added after `iteration` (a resume from a checkpoint of that
        iteration judges those batches again); rollbacks stay. Returns how many were dropped."""
        kept = [r for r in self._ranges if not (r.kind == LedgerKind.SKIP and r.iteration > iteration)]
        dropped = len(self._ranges) - len(kept)
        if dropped:
            self._ranges = kept
            self._remerge()
        return dropped

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
            "ranges": [{"start": r.start, "end": r.end, "reason": r.reason, "kind": r.kind,
                        "iteration": r.iteration, **({"details": r.details} if r.details else {})}
                       for r in self._ranges],
        })


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
