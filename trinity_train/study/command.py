"""`trinity-train ablate --study FILE [--out DIR] [--nproc N]`: check the study whole, run the cells
that are not done, write the report.

Everything that can be wrong with the study file, its base config, a cell's config or the output
directory (a cell directory holding a run of another config) is reported before any cell runs.
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
from trinity_train.study.cells import recorded_config_mismatch, study_cells, study_hash
from trinity_train.study.layout import StudyDir
from trinity_train.study.report import build_summary, write_study_report
from trinity_train.study.runner import check_launcher, run_cells, write_cell_configs
from trinity_train.study.spec import StudyError, load_study
from trinity_train.study.state import FAILED, StudyState


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


def run_ablate(study_file: str, out_dir: str | None, nproc: int, command: str,
               say: Callable[[str], None] = say_now) -> int:
    started, load_start = time.time(), load_average()
    if nproc < 1:
        raise StudyError(f"--nproc must be at least 1, got {nproc}")
    study = load_study(study_file)
    out = StudyDir(out_dir or default_out(study.name))
    _check_out(out)
    cells = study_cells(study, out, nproc)
    for cell in cells:
        if (mismatch := recorded_config_mismatch(cell, out)) is not None:
            raise StudyError(f"{out.cell(cell.name).path} holds a run of another config ({mismatch}): the study "
                             f"changed since that cell ran; write it to another --out, or delete that directory "
                             f"to run the cell again")
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
        say(f"study {study.name}: {len(cells)} cells, config hash {config_hash[:16]}, in {out.path}")
        results = run_cells(cells, out, state, nproc=nproc, keep_checkpoints=study.keep_checkpoints, say=say)
        run = {"command": command, "started": started, "wall_s": time.time() - started, "load_start": load_start,
               "load_end": load_average(), "cpus": os.cpu_count()}
        state.invocations.append(run)
        state.save()
        write_study_report(build_summary(study, cells, config_hash, out, state, run, nproc), out)
    finally:
        lock.release()
    say(f"report: {out.table} (summary.json, plots/, report.html beside it)")

    failed = [r.cell.name for r in results if r.status == FAILED]
    if failed:
        raise StudyCellsFailedError(f"{len(failed)} of {len(cells)} cells failed ({', '.join(failed)}); their "
                                    f"consoles are in {out.path / 'logs'}; run the same command again to retry them")
    return 0


def _check_out(out: StudyDir) -> None:
    """--out must be a directory, or a path a directory can be made at."""
    for path in (out.path, *out.path.parents):
        if path.exists():
            if not path.is_dir():
                raise StudyError(f"--out {out.path}: {path} is not a directory; name a directory (it is created "
                                 f"if missing)")
            return
