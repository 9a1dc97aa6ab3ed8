"""The per-rank hang watchdog (`[watchdog]`, DESIGN §12): a daemon thread that knows which phase of
the loop its rank is in and since when, and ends the rank restartably when a phase outlasts its
limit (`limits.PhaseLimits`).

It hears the phases as a built-in callback of the Trainer (`phase_begin`). A phase lasts until
the next one begins, so what runs between two phases (the records after a step, a rollback's
search, what `after_iteration` callbacks do) counts as the earlier one and nothing between the
start and the end is unwatched. From `Trainer.start()` to the first phase the rank is in
`startup` (the restore, the first records, the peak-FLOPs probe), limited by `watchdog.first_s`;
joining the job and building the model come before it and are bounded by
`parallel.init_timeout_s` and `parallel.collective_timeout_s`. The thread stops when the
`shutdown` phase ends (however the run ended), or when the trainer is collected unfinished.

On expiry the rank reads the others' heartbeats (`heartbeat.Heartbeat`, a few seconds at most),
writes its stacks and a `hang` event (`hang.report_hang`), prints one line, tells a launcher the
failure is restartable (`launcher_verdict.mark_restartable`) and leaves with
`exit_codes.RESTARTABLE` through `os._exit`: its main thread is stuck, so nothing else would end
it, and torchrun then restarts the job.

The loop's thread pays two clock reads and a few assignments per phase entry; the watchdog's
thread wakes once per tick (at most 1 s), publishes the heartbeat when it changed and compares
one clock (benchmarks/watchdog_cost.py).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import weakref
from typing import Any

from trinity_train import exit_codes
from trinity_train.callbacks import TrainerCallback
from trinity_train.config import WatchdogConfig
from trinity_train.health.hang import Hang, report_hang
from trinity_train.health.heartbeat import Heartbeat, job_store
from trinity_train.health.limits import PhaseLimits
from trinity_train.launcher_verdict import mark_restartable
from trinity_train.records import Phase
from trinity_train.rundir import RunDir

HEARTBEAT_READ_S = 5.0  # how long an expired rank waits for the others' heartbeats


def tick_seconds(cfg: WatchdogConfig) -> float:
    """How often the thread looks: a twentieth of the floor, between 50 ms and 1 s."""
    return min(1.0, max(0.05, cfg.floor_s / 20))


class Watchdog:
    """The thread and what it watches; `enter` is the loop's side, the rest the thread's."""

    def __init__(self, cfg: WatchdogConfig, rundir: RunDir, rank: int, world_size: int = 1):
        self.cfg, self.rundir, self.rank, self.world_size = cfg, rundir, rank, world_size
        self.limits = PhaseLimits(cfg)
        self.heartbeat = Heartbeat(rank, world_size)
        self.tick_s = tick_seconds(cfg)
        self._current: tuple[str, float] = (str(Phase.STARTUP), time.monotonic())
        self._iteration = lambda: self.heartbeat.iteration
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, state: Any | None = None, store: Any | None = None) -> None:
        """Watch from now on, in `startup`; `state` (the trainer's counters) names the iteration
        a hang is reported at, `store` carries the heartbeats (None: this rank's alone)."""
        if self.running:
            return
        if state is not None:
            self._iteration = lambda: state.iteration
        self.heartbeat.store = store
        self._current = (str(Phase.STARTUP), time.monotonic())
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="trinity-watchdog", daemon=True)
        self._thread.start()

    def enter(self, phase: str, iteration: int) -> None:
        """The loop entered `phase` (its thread): the phase before it ended now."""
        now = time.monotonic()
        previous, since = self._current
        self.limits.observe(previous, now - since)
        self._current = (str(phase), now)
        self.heartbeat.beat(str(phase), iteration)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.heartbeat.publish()
            except Exception:  # noqa: BLE001 - the store is gone (its host left): beats are best-effort
                self.heartbeat.store = None
            current = self._current
            phase, since = current
            waited, limit = time.monotonic() - since, self.limits.limit(phase)
            if waited > limit and self._current is current and not self._stop.is_set():
                self.expire(phase, waited, limit)

    def expire(self, phase: str, waited_s: float, limit_s: float) -> None:
        """The rank hung in `phase`: report it and leave restartably (never returns)."""
        try:
            hang = Hang(rank=self.rank, host=socket.gethostname(), phase=phase, iteration=self._iteration(),
                        waited_s=waited_s, limit_s=limit_s, behind=self.heartbeat.behind(HEARTBEAT_READ_S))
            line = report_hang(self.rundir, hang)
            print(line, file=sys.stderr, flush=True)
            mark_restartable(line)
        finally:
            os._exit(exit_codes.RESTARTABLE)


class WatchdogCallback(TrainerCallback):
    """The watchdog as a built-in callback of the Trainer: `start(trainer)` from `Trainer.start`,
    each `phase_begin` moves it on, the end of `shutdown` stops it. Off with `watchdog.enabled =
    false`."""

    def __init__(self, cfg: WatchdogConfig, rundir: RunDir, rank: int, world_size: int = 1):
        self.watchdog = Watchdog(cfg, rundir, rank, world_size) if cfg.enabled else None
        if self.watchdog is not None:  # a trainer dropped unfinished must not leave it watching
            weakref.finalize(self, self.watchdog.stop)

    def start(self, trainer: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.start(trainer.state, job_store() if self.watchdog.world_size > 1 else None)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def phase_begin(self, trainer, phase) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(phase, trainer.state.iteration)

    def phase_end(self, trainer, phase, seconds) -> None:
        if phase == Phase.SHUTDOWN:
            self.stop()
