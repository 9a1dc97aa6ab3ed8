"""What a study's numbers depend on besides its config, recorded so that anyone can tell what
produced them and run it again: the code's commit and whether its working tree was clean, the
interpreter and the numeric libraries, the CPU, and the data (the hashes of each dataset's
manifest and tokenizer; the default corpus and its tokenizer are built from the running
interpreter's standard library, so they differ between Python versions).

`git_state` reads the checkout this package runs from. The study's own output directory, when it
lies inside that checkout (`docs/studies/...`), is not a change to the code: it is left out of the
dirty check, which is made at the start and again before every cell.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from trinity_train.config import Config

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository holding this package
SHOWN_CHANGES = 5  # changed paths named in a refusal


@dataclass(frozen=True)
class GitState:
    commit: str | None  # None: the package does not run from a git checkout
    changes: tuple[str, ...] = ()  # `git status --porcelain` lines, the study's output left out

    @property
    def dirty(self) -> bool | None:
        return None if self.commit is None else bool(self.changes)

    def describe_changes(self) -> str:
        shown = ", ".join(line.strip() for line in self.changes[:SHOWN_CHANGES])
        more = len(self.changes) - SHOWN_CHANGES
        return shown + (f" and {more} more" if more > 0 else "")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(out: Path | None = None) -> GitState:
    """The commit this package runs from and the uncommitted changes of its checkout (tracked and
    untracked files, ignored ones not), less anything under `out`."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return GitState(None)
    pathspec = ["--", "."]
    if out is not None:
        try:
            inside = Path(out).resolve().relative_to(CHECKOUT.resolve())
        except ValueError:
            inside = None
        if inside is not None and inside.parts:
            pathspec.append(f":(exclude){inside.as_posix()}")
    status = _git("status", "--porcelain", "--untracked-files=all", *pathspec)
    changes = tuple(line for line in (status or "").splitlines() if line.strip())
    return GitState(head.strip(), changes)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def data_hashes(cfg: Config) -> list[dict]:
    """Per dataset the run reads: its directory and the sha256 of its manifest and tokenizer
    (None where not there: the default corpus is built by the first cell)."""
    from trinity_train.data.loader import dataset_dirs  # loads torch: only when the report is written
    from trinity_train.data.shards import MANIFEST, TOKENIZER_FILE
    return [{"path": str(d), "manifest_sha256": _sha256(d / MANIFEST), "tokenizer_sha256": _sha256(d / TOKENIZER_FILE)}
            for d in dataset_dirs(cfg.data, build_default=False)]


def provenance(git: GitState, allow_dirty: bool, cfg: Config, config_hash: str) -> dict:
    """summary.json's `provenance`: what the numbers depend on besides the cells' configs."""
    return {"commit": git.commit, "dirty": git.dirty, "changes": list(git.changes), "allow_dirty": allow_dirty,
            "python": platform.python_version(), "torch": _version("torch"), "numpy": _version("numpy"),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "data": data_hashes(cfg), "config_hash": config_hash}
