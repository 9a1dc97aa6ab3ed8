"""Each rank's progress, so that a rank that hung can say which ranks are behind (DESIGN §12).

The loop's thread only counts: on each phase entry `beat(phase, iteration)` writes three
attributes (no I/O, no lock). The watchdog's thread publishes the count, at most once per tick
and only when it changed, to the job's c10d store (the default process group's store, under a
prefix of this torchrun attempt), and on expiry reads every rank's back, bounded in time. Ranks
in step enter the same phases in the same order, so the one whose count is lowest has fallen
behind: a rank stuck drawing its batch while the others wait for it in the step's collectives.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from trinity_train.records import Phase


@dataclass(frozen=True)
class Progress:
    """What a rank last reported: phase entries so far, the phase, the iteration."""

    beats: int
    phase: str
    iteration: int


def behind(progress: dict[int, Progress | None]) -> list[int] | None:
    """The ranks whose progress is lowest, when some are behind others; None when all are level
    or there is nothing to compare. A rank that never reported (None) counts as no progress."""
    if len(progress) < 2:
        return None
    beats = {rank: (p.beats if p is not None else 0) for rank, p in progress.items()}
    lowest = min(beats.values())
    if lowest == max(beats.values()):
        return None
    return sorted(rank for rank, b in beats.items() if b == lowest)


def job_store() -> Any | None:
    """The default process group's c10d store under this attempt's prefix, or None outside a
    distributed job."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trinity_train/heartbeat/{attempt}/", store)


class Heartbeat:
    """This rank's progress (written by the loop) and the others' (read through `store`)."""

    def __init__(self, rank: int, world_size: int, store: Any | None = None):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.beats, self.phase, self.iteration = 0, str(Phase.STARTUP), 0
        self._published = -1

    def beat(self, phase: str, iteration: int) -> None:
        """The loop entered `phase` at `iteration` (the loop's thread; costs three assignments)."""
        self.phase, self.iteration = phase, iteration
        self.beats += 1

    def progress(self) -> Progress:
        return Progress(self.beats, self.phase, self.iteration)

    def publish(self) -> None:
        """Put this rank's progress into the store when it changed (the watchdog's thread)."""
        mine = self.progress()
        if self.store is None or mine.beats == self._published:
            return
        self.store.set(str(self.rank), json.dumps([mine.beats, mine.phase, mine.iteration]))
        self._published = mine.beats

    def _read(self, rank: int) -> Progress | None:
        if rank == self.rank:
            return self.progress()
        if not self.store.check([str(rank)]):
            return None
        beats, phase, iteration = json.loads(self.store.get(str(rank)))
        return Progress(int(beats), str(phase), int(iteration))

    def read_all(self, timeout_s: float) -> dict[int, Progress | None] | None:
        """Every rank's progress, or None when the store is absent or does not answer within
        `timeout_s` (its host may be the rank that hung, or gone)."""
        if self.store is None or self.world_size < 2:
            return None
        found: dict[int, Progress | None] = {}

        def read() -> None:
            try:
                for rank in range(self.world_size):
                    found[rank] = self._read(rank)
            except Exception:  # noqa: BLE001 - a store that is gone: nothing to compare
                found.clear()

        reader = threading.Thread(target=read, name="trinity-heartbeat-read", daemon=True)
        reader.start()
        reader.join(timeout_s)
        return None if reader.is_alive() or len(found) < self.world_size else found

    def behind(self, timeout_s: float) -> list[int] | None:
        """`behind` of every rank's progress; None when it cannot tell."""
        progress = self.read_all(timeout_s)
        return None if progress is None else behind(progress)
