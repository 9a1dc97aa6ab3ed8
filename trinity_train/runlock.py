"""A run owns its directory: `<run.dir>/.lock` (`RunDir.lock`), an OS file lock held for the run's life.

Two processes training into one directory destroy each other: one renames the other's
metrics.jsonl away, commits or cleans up the other's half-written checkpoints. So a start takes an
exclusive `flock` on the lock file before it touches anything else in the directory, and writes
who holds it (host, pid, start time) into the file; a second start on a live directory is refused
in one line naming that holder. The kernel releases the lock when the process ends, however it
ends (SIGKILL, OOM, a lost node's reboot), so a killed run never blocks its own resume: a lock
file nobody holds is just a file.

Under torchrun the ranks of one job are one run: rank 0 takes the lock and every rank waits for
its decision (a refusal is raised on every rank) before any of them touches a file. Only rank 0's
host holds it, which is enough: every other start of a run on that directory goes through its
rank 0 too. On several nodes the run directory is on a shared file system; `flock` works across
hosts on NFS (v4, or v3 with lockd) and on Lustre mounted with `flock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from trinity_train.errors import UserError
from trinity_train.rank_zero import decided_by_rank_zero
from trinity_train.rundir import RunDir

_HOLDER_WAIT_S = 1.0  # a holder writes its name right after locking; a reader waits that long for it


class RunDirInUseError(UserError):
    """Another live run holds the run directory."""


class RunDirLock:
    """The lock of one run directory, held by this process until `release()`."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self._created = path, fd, created

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        """Lock `run_dir` (created if need be) for this process, or RunDirInUseError naming the
        live run that holds it; nothing else in the directory is touched either way."""
        rundir = RunDir(run_dir)
        rundir.require_writable()
        created = [p for p in (rundir.path, *rundir.path.parents) if not p.exists()]
        rundir.path.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(rundir.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(fd)
                os.close(fd)
                raise RunDirInUseError(f"run.dir: '{rundir.path}' is in use by another run ({holder}); wait for "
                                       "it to end (or stop it), or choose another --run.dir") from None
            if _still_named(fd, rundir.lock):
                break
            os.close(fd)  # a releasing run removed the file after we opened it: lock the new one
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return cls(rundir.lock, fd, created)

    def release(self) -> None:
        """Unlock; a run directory this lock created and nothing else used is removed again, so
        a start refused by a later check (bad data) leaves no trace."""
        if self._fd is None:
            return
        if self._created and [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
            self.path.unlink()  # while locked: a start that opened it sees it unnamed and retries
            for directory in self._created:
                with contextlib.suppress(OSError):  # not empty: something else lives there now
                    directory.rmdir()
        os.close(self._fd)  # closing the only descriptor releases the flock
        self._fd = None


def _still_named(fd: int, path: Path) -> bool:
    """Whether the file open as `fd` is still the one at `path`."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _describe_holder(fd: int) -> str:
    """'pid P on host H, started T' from the lock file's content, once its holder has written it."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
            return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        except (ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "its holder has not written its name into the lock file"
            time.sleep(0.05)


@contextlib.contextmanager
def run_dir_owned(run_dir: str | Path) -> Iterator[None]:
    """Hold the lock of `run_dir` for the job while the block runs (collective: rank 0 locks,
    every rank gets its decision; a refusal is a RunDirInUseError on every rank)."""
    held: list[RunDirLock] = []
    decided_by_rank_zero(lambda: held.append(RunDirLock.acquire(run_dir)))
    try:
        yield
    finally:
        for lock in held:
            lock.release()
