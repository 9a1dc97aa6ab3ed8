"""What one `prepare-data` run adds to its output directory, so that a refused run can take it
back and leave the directory as it found it.

A refusal that the inputs or options decide before anything is written is raised before the
directory is touched (prepare.py); this is for those found on the way (too few documents for a
validation split, a malformed record a task reads). Only paths under the names prepare-data owns
are considered, and only those that were not there when the run took the directory's lock: what
an earlier run left (a killed run's finished tasks, its trained tokenizer) stays, so it is still
resumable, and nothing else living in the directory is looked at. (A file of an earlier build
that this one rewrote, or state of another build it replaced, is not restored.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path


class Footprint:
    """Made before the run touches `out`; `snapshot()` once it holds the lock, `take_back()` to undo."""

    def __init__(self, out: Path, owned: tuple[str, ...], lock: str):
        """`owned`: glob patterns of the top-level names runs write; `lock`: the lock file's name."""
        self.out, self.owned = out, owned
        self.created_dirs = [p for p in (out, *out.parents) if not p.exists()]  # `out` and missing parents
        self.lock = out / lock
        self.lock_existed = self.lock.exists()
        self.before: set[Path] = set()

    def snapshot(self) -> None:
        """What is there once the run holds the lock (what a run before it left is not this run's)."""
        self.before = set(self._owned_paths())
        if not self.lock_existed:
            self.before.discard(self.lock)

    def _owned_paths(self):
        for pattern in self.owned:
            for top in self.out.glob(pattern):
                yield top
                if top.is_dir() and not top.is_symlink():
                    yield from top.rglob("*")

    def take_back(self) -> None:
        """Remove what this run created, holding its lock (the lock file may be among it: a run
        waiting on it finds it unlinked and makes a new one)."""
        for path in sorted(set(self._owned_paths()) - self.before, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # children go before their directories
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        for directory in self.created_dirs:
            with contextlib.suppress(OSError):  # not empty: something else lives there now
                directory.rmdir()
