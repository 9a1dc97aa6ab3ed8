"""Where the time of every attempt goes: `timeline.jsonl` (docs/CONTRACT.md), read back by
`goodput`.

The main process of each attempt (a start, a torchrun restart, a resume) appends an `attempt`
record when its loop begins (with the moment its process started, so start-up is counted from
there), one `iteration` record per iteration with the seconds of each phase inside it, a `span`
for a phase outside any iteration (the first validation, the last save's wait), and an `end` when
it finishes. Each record starts where the previous one ended, so an attempt's records cover it
without a gap; what a killed attempt was doing after its last record, and the restart after it,
is the gap before the next attempt's process started.
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict
from pathlib import Path

from trinity_train.callbacks import TrainerCallback
from trinity_train.observe.jsonl import JsonlWriter
from trinity_train.records import TimelineKind, timeline_record

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def process_start_time() -> float:
    """When this process started (Unix seconds, to the kernel's clock tick), from /proc: its start
    in ticks since boot, against the boot clock now (btime in /proc/stat is whole seconds: too
    coarse to order a restarted worker after the one it replaced); now where /proc is absent."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class TimelineWriter(TrainerCallback):
    """Writes timeline.jsonl on the main process. The trainer calls `iteration_begun` and
    `iteration_done` around each iteration and `close` last; the phases arrive as callbacks."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self.file: JsonlWriter | None = None
        self.boundary = 0.0  # where the next record starts: the previous one's end
        self.in_iteration = False
        self.phases: dict[str, float] = defaultdict(float)
        self.rollback_to_iter: int | None = None

    def on_start(self, trainer) -> None:
        if not self.enabled:
            return
        self.file = JsonlWriter(self.path)
        self.boundary = time.time()
        restart = os.environ.get(RESTART_ENV)
        self.file.write(timeline_record(
            TimelineKind.ATTEMPT, host=socket.gethostname(), pid=os.getpid(), process_start=process_start_time(),
            start=self.boundary, iter=trainer.state.iteration, step=trainer.state.step,
            devices=trainer.dims.world_size, restart=int(restart) if restart and restart.isdigit() else None))

    def iteration_begun(self) -> None:
        self.in_iteration = True

    def phase_end(self, trainer, phase, seconds) -> None:
        if self.file is None:
            return
        if self.in_iteration:
            self.phases[phase] += seconds
        elif phase != "shutdown":  # the end record covers the shutdown
            end = time.time()
            self.file.write(timeline_record(TimelineKind.SPAN, phase=phase, iter=trainer.state.iteration,
                                            start=self.boundary, end=end))
            self.boundary = end

    def on_rollback(self, trainer, event) -> None:
        self.rollback_to_iter = event["to_iter"]

    def iteration_done(self, trainer, batch_index: int, skipped: bool, failed: bool) -> None:
        """The iteration ended: its step `skipped`, or `failed` (it raised before its step was
        complete: a lost peer, a crash)."""
        self.in_iteration = False
        if self.file is None:
            return
        end = time.time()
        self.file.write(timeline_record(
            TimelineKind.ITERATION, iter=trainer.state.iteration, step=trainer.state.step, batch=batch_index,
            skipped=skipped, start=self.boundary, end=end, phases=dict(self.phases),
            rollback_to_iter=self.rollback_to_iter, failed=True if failed else None))
        self.boundary = end
        self.phases.clear()
        self.rollback_to_iter = None

    def close(self, trainer, status: str) -> None:
        """The attempt ended with `status` (records.ENDED, HALTED or FAILED)."""
        if self.file is None:
            return
        self.file.write(timeline_record(TimelineKind.END, iter=trainer.state.iteration, step=trainer.state.step,
                                        end=time.time(), status=status))
        self.file.close()
        self.file = None
