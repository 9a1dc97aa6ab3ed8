"""What a rank leaves behind when its watchdog finds it hung (DESIGN §12): every thread's Python
stack in the run directory, a `hang` event, and one line on stderr saying what happened and what
happens next. The caller then exits with `exit_codes.RESTARTABLE`.

Any rank writes these itself (rank 0's recorder cannot write for a rank that is stuck, and may
be stuck itself): the stack file is complete or absent (a temporary sibling renamed), and the
event is one whole line appended to events.jsonl (`RunDir.append_event`).
"""

from __future__ import annotations

import faulthandler
import os
from dataclasses import dataclass
from pathlib import Path

from trinity_train import exit_codes
from trinity_train.files import atomic_open
from trinity_train.records import EventName, event
from trinity_train.rundir import RunDir


@dataclass(frozen=True)
class Hang:
    """A rank that made no progress: where, since when, against what limit."""

    rank: int
    host: str
    phase: str
    iteration: int
    waited_s: float
    limit_s: float
    behind: list[int] | None = None  # the ranks behind the others (None: unknown or level)

    def header(self) -> str:
        return (f"trinity-train watchdog: rank {self.rank} on {self.host}, phase '{self.phase}' at iteration "
                f"{self.iteration}: no progress for {self.waited_s:.1f} s (limit {self.limit_s:.1f} s); "
                f"ranks behind: {self.behind if self.behind is not None else 'unknown'}")


def write_stacks(path: Path, header: str) -> Path:
    """Every thread's Python stack of this process (`faulthandler`) into `path`, whole or absent."""
    with atomic_open(path) as f:
        f.write(header + "\n\n")
        f.flush()  # faulthandler writes to the descriptor, after what is buffered here
        faulthandler.dump_traceback(f, all_threads=True)
    return path


def what_happens_next() -> str:
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return ("torchrun restarts the job, which resumes from its newest sound checkpoint (with no restart "
                "left, the launcher exits 75 for the scheduler to requeue)")
    return "run it again with --checkpoint.resume=auto to resume from its newest sound checkpoint"


def report_hang(rundir: RunDir, hang: Hang) -> str:
    """Write the stacks and the `hang` event of `hang`; returns the one line to print. A file that
    cannot be written is named as such in the line: the rank must exit all the same."""
    code = exit_codes.RESTARTABLE
    stacks: str | None = None
    try:
        path = write_stacks(rundir.hang_stacks(hang.rank, hang.iteration), hang.header())
        stacks = str(path.relative_to(rundir.path))
    except OSError as e:
        where = f"not written ({e.strerror or e})"
    else:
        where = f"in {path}"
    try:
        rundir.append_event(event(EventName.HANG, iter=hang.iteration, rank=hang.rank, host=hang.host,
                                  phase=hang.phase, waited_s=round(hang.waited_s, 3),
                                  limit_s=round(hang.limit_s, 3), stacks=stacks, behind=hang.behind,
                                  exit_code=code))
    except OSError:
        pass  # the line below still says it all
    behind = "" if hang.behind is None else f"; behind the others: rank {', '.join(map(str, hang.behind))}"
    return (f"watchdog: rank {hang.rank} on {hang.host} hung in phase '{hang.phase}' at iteration "
            f"{hang.iteration}: no progress for {hang.waited_s:.1f} s (limit {hang.limit_s:.1f} s){behind}; "
            f"every thread's stack is {where}; exiting {code} (restartable): {what_happens_next()}")
