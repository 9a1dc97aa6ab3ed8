"""`trinity-train ablate --study FILE [--out DIR] [--nproc N] [--allow-dirty]`: check the study
whole, run the cells that are not done, write the report.

Everything that can be wrong with the study file, its base config, a cell's config or the output
directory (a cell directory holding a run of another config, or a cell done at another commit of
the code) is reported before any cell runs, and so is a working tree with uncommitted changes
(unless `--allow-dirty`, which the summary records): a study's cells must all run one commit's
code, and the report names it (`provenance.py`). The tree is checked again before every cell, so a
commit landing while the study runs stops it rather than mixing two codes in one report.
The report is written even when some cells failed; the command then exits 1, and running it again
retries exactly those cells.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from trinity_train.errors import UserError
from trinity_train.files import output_directory
from trinity_train.study.cells import cell_hash, recorded_config_mismatch, study_cells, study_hash
from trinity_train.study.layout import StudyDir
from trinity_train.study.provenance import GitState, git_state
from trinity_train.study.report import build_summary, write_study_report
from trinity_train.study.runner import check_launcher, run_cells, write_cell_configs
from trinity_train.study.spec import StudyError, load_study
from trinity_train.study.state import DONE, FAILED, StudyState


class StudyCellsFailedError(UserError):
    """Some cells crashed (not diverged: that is a result); the report is written without them."""


def load_average() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def default_out(study_name: str) -> Path:
    return Path("runs") / "studies" / study_name


def say_now(message: str) -> None:
    print(message, flush=True)  # a study runs for an hour: its progress must not wait in a pipe's buffer


def check_code(git: GitState, allow_dirty: bool) -> None:
    """Refuse to run a study on code no commit names, unless told to."""
    if allow_dirty:
        return
    if git.commit is None:
        raise StudyError("the code does not run from a git checkout, so the report could not name its commit: run "
                         "the study from a checkout, or pass --allow-dirty to run it anyway (summary.json records that)")
    if git.dirty:
        raise StudyError(f"the working tree of the code has uncommitted changes ({git.describe_changes()}), so no "
                         f"commit names the code the cells would run: commit or stash them, or pass --allow-dirty "
                         f"(summary.json records that)")


def check_cells_commit(cells, out: StudyDir, state: StudyState, git: GitState) -> None:
    """Refuse to add cells of this commit to a study whose done cells ran at another one."""
    for cell in cells:
        record = state.cell(cell.name)
        if record["status"] not in DONE or not out.cell(cell.name).metrics.is_file():
            continue
        commits = record["commits"]
        if commits != [git.commit]:
            ran = f"commit {', '.join(c[:12] for c in commits)}" if commits else "an unrecorded commit"
            raise StudyError(f"{out.cell(cell.name).path} ran at {ran} but the code is at "
                             f"{git.commit[:12] if git.commit else 'no commit'} now, and a report must come from one "
                             f"commit: write this study to another --out, or check out that commit to finish it")


def run_ablate(study_file: str, out_dir: str | None, nproc: int, command: str,
               say: Callable[[str], None] = say_now, allow_dirty: bool = False) -> int:
    started, load_start = time.time(), load_average()
    if nproc < 1:
        raise StudyError(f"--nproc must be at least 1, got {nproc}")
    study = load_study(study_file)
    out = StudyDir(out_dir or default_out(study.name))
    output_directory(out.path, "--out")
    cells = study_cells(study, out, nproc)
    for cell in cells:
        if (mismatch := recorded_config_mismatch(cell, out)) is not None:
            raise StudyError(f"{out.cell(cell.name).path} holds a run of another config ({mismatch}): the study "
                             f"changed since that cell ran; write it to another --out, or delete that directory "
                             f"to run the cell again")
    git = git_state(out.path)
    check_code(git, allow_dirty)
    config_hash = study_hash(cells)
    out.path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out.lock, timeout=0)  # two studies in one directory would train the same cells
    try:
        lock.acquire()
    except Timeout:
        raise StudyError(f"another `trinity-train ablate` is running in {out.path}; wait for it to finish, "
                         f"or write this one to another --out") from None
    try:
        write_cell_configs(cells, out)
        check_launcher(cells, out, nproc)
        state = StudyState(out.state)
        check_cells_commit(cells, out, state, git)
        say(f"study {study.name}: {len(cells)} cells, config hash {config_hash[:16]}, commit "
            f"{git.commit[:12] if git.commit else 'none'}{' (dirty)' if git.dirty else ''}, in {out.path}")
        results = run_cells(cells, out, state, nproc=nproc, keep_checkpoints=study.keep_checkpoints, say=say,
                            code=lambda: _same_code(git, out, allow_dirty), hashes={c.name: cell_hash(c) for c in cells})
        run = {"command": command, "started": started, "wall_s": time.time() - started, "load_start": load_start,
               "load_end": load_average(), "cpus": os.cpu_count(), "commit": git.commit, "dirty": git.dirty,
               "allow_dirty": allow_dirty}
        state.invocations.append(run)
        state.save()
        write_study_report(build_summary(study, cells, config_hash, out, state, run, nproc, git=git,
                                         allow_dirty=allow_dirty), out)
    finally:
        lock.release()
    say(f"report: {out.table} (summary.json, plots/, report.html beside it)")

    failed = [r.cell.name for r in results if r.status == FAILED]
    if failed:
        raise StudyCellsFailedError(f"{len(failed)} of {len(cells)} cells failed ({', '.join(failed)}); their "
                                    f"consoles are in {out.path / 'logs'}; run the same command again to retry them")
    return 0


def _same_code(started: GitState, out: StudyDir, allow_dirty: bool) -> GitState:
    """The code's state before a cell: the study's commit, else a StudyError (the cells done so far
    keep their results; the report is not written from two codes)."""
    now = git_state(out.path)
    if now.commit != started.commit:
        raise StudyError(f"the code moved from commit {started.commit and started.commit[:12]} to "
                         f"{now.commit and now.commit[:12]} while the study ran, and a report must come from one "
                         f"commit: check out {started.commit and started.commit[:12]} and run the same command to "
                         f"finish it, or write the study to another --out")
    if now.dirty and not allow_dirty:
        raise StudyError(f"the working tree of the code changed while the study ran ({now.describe_changes()}): "
                         f"restore it and run the same command to finish the study")
    return now
