"""Run a study's cells one after another, each in its own process, so that a crash or a divergence
ends that cell only.

A cell runs as `python -m trinity_train.cli train --config configs/NAME.toml --run.dir=cells/NAME`,
or, with `nproc > 1`, as its own torchrun job through `launch/local.sh N` (the cells' micro-batches
are split over the data-parallel ranks, so they train on the same global batches). Its console
goes to `logs/NAME.log`. A cell that is done (`state.run_outcome`) is not run again; the others
continue from their newest checkpoint. The trainer's exit code says how a run ended: 0 finished,
3 halted as diverged (`stability.guard.HALT_EXIT_CODE`), anything else failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trinity_train import exit_codes
from trinity_train.config import save_config
from trinity_train.records import RecordKind
from trinity_train.study.cells import Cell
from trinity_train.study.layout import StudyDir
from trinity_train.study.spec import StudyError
from trinity_train.study.state import DIVERGED, DONE, FAILED, FINISHED, StudyState, run_outcome

HALT_EXIT_CODE = exit_codes.DIVERGED  # the trainer halted a diverged run (the study runs it, never imports it)
LAUNCH_LOCAL = Path(__file__).resolve().parents[2] / "launch" / "local.sh"


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    status: str  # FINISHED, DIVERGED or FAILED
    ran: bool  # False: it was done before this invocation
    wall_s: float = 0.0
    exit_code: int | None = None
    reason: str = ""


def _environment() -> dict[str, str]:
    """This interpreter's bin directory first on PATH, so that launch/local.sh finds the same
    python and torchrun."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the console script sets it (cli.passive_openmp_waits)
    return env


def cell_command(cell: Cell, out: StudyDir, nproc: int) -> list[str]:
    args = ["--config", str(out.cell_config(cell.name)), f"--run.dir={out.cell(cell.name).path}"]
    if nproc > 1:
        return ["bash", str(LAUNCH_LOCAL), str(nproc), *args]
    return [sys.executable, "-m", "trinity_train.cli", "train", *args]


def check_launcher(cells: list[Cell], out: StudyDir, nproc: int) -> None:
    """With nproc > 1: the launcher exists and the cells' layout fits nproc ranks (the launcher's
    own preflight, run once here so that a bad layout stops the study before any cell)."""
    if nproc <= 1 or not cells:
        return
    if not LAUNCH_LOCAL.is_file():
        raise StudyError(f"--nproc {nproc} runs each cell with launch/local.sh, which is not at {LAUNCH_LOCAL} "
                         f"(an installed copy without the source tree): run the study from a checkout")
    result = subprocess.run([sys.executable, "-m", "trinity_train.parallel.preflight", str(nproc),
                             "--config", str(out.cell_config(cells[0].name))],
                            capture_output=True, text=True, env=_environment())
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit code {result.returncode}"
        raise StudyError(f"--nproc {nproc}: {message.removeprefix('error: ')}")


def write_cell_configs(cells: list[Cell], out: StudyDir) -> None:
    for cell in cells:
        save_config(cell.config, out.cell_config(cell.name))


def _last_error_line(log: Path, offset: int) -> str:
    """The last `error: ...` line the attempt that started at `offset` wrote, or ''."""
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def _exit_description(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def run_one(cell: Cell, out: StudyDir, nproc: int) -> tuple[int, float, str]:
    """Train the cell to its end: (exit code, wall seconds, last error line)."""
    log = out.cell_log(cell.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = cell_command(cell, out, nproc)
    with open(log, "ab") as f:
        offset = f.tell()
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n".encode())
        f.flush()
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_environment())
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the cell too; let it write its run_end, then stop
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        wall = time.perf_counter() - started
    return code, wall, _last_error_line(log, offset)


def _settle(cell: Cell, out: StudyDir, code: int, error: str) -> tuple[str, str]:
    """(status, reason) of a cell that just ran, from its run directory and its exit code."""
    outcome = run_outcome(out.cell(cell.name), cell.config.train.steps)
    if outcome is not None and outcome.status == DIVERGED:
        return DIVERGED, outcome.reason
    if outcome is not None:  # its last step and run_end are written: its records are complete
        return FINISHED, "" if code == 0 else f"finished its steps, then {_exit_description(code)}: {error}"
    if code == HALT_EXIT_CODE:
        return DIVERGED, error.removeprefix("error: ")
    why = "it exited without finishing its steps" if code == 0 else _exit_description(code)
    return FAILED, f"{why}: {error}" if error else why


def _detail(cell: Cell, out: StudyDir, reason: str) -> str:
    if reason:
        return f": {reason}"
    last = [r for r in out.cell(cell.name).read_metrics(RecordKind.VAL) if r.get("val_loss") is not None][-1:]
    return f" (validation loss {last[0]['val_loss']:.4f})" if last else ""


def _drop_checkpoints(cell: Cell, out: StudyDir) -> None:
    """A done cell's checkpoints are never read again: the report needs only its metrics."""
    shutil.rmtree(out.cell(cell.name).checkpoints, ignore_errors=True)


def run_cells(cells: list[Cell], out: StudyDir, state: StudyState, *, nproc: int = 1, keep_checkpoints: bool = False,
              say: Callable[[str], None], code: Callable[[], Any] | None = None,
              hashes: dict[str, str] | None = None) -> list[CellResult]:
    """Run the cells not done. `code()`, called before each cell that trains, returns the code's
    `provenance.GitState` (its commit and dirty flag go into the state file with the attempt) or
    raises StudyError when the code changed since the study started; `hashes`: each cell's
    config hash, recorded with it."""
    results = []
    width = len(str(len(cells)))
    for number, cell in enumerate(cells, 1):
        prefix = f"[{number:>{width}}/{len(cells)}] {cell.name}:"
        done = run_outcome(out.cell(cell.name), cell.config.train.steps)
        if done is not None:
            if state.cell(cell.name)["status"] != done.status:  # ended, but the state file missed it
                state.record(cell.name, done.status, exit_code=None, wall_s=0.0, reason=done.reason, attempt=False)
            say(f"{prefix} {done.status} before, not run again")
            results.append(CellResult(cell, done.status, ran=False, reason=done.reason))
        else:
            git = code() if code else None
            state.attempt(cell.name, commit=git.commit if git else None, dirty=git.dirty if git else None,
                          config_sha256=(hashes or {}).get(cell.name))
            say(f"{prefix} training (console: {out.cell_log(cell.name)})")
            exit_code, wall, error = run_one(cell, out, nproc)
            status, reason = _settle(cell, out, exit_code, error)
            state.record(cell.name, status, exit_code=exit_code, wall_s=wall, reason=reason)
            say(f"{prefix} {status} in {wall:.0f} s{_detail(cell, out, reason)}")
            results.append(CellResult(cell, status, ran=True, wall_s=wall, exit_code=exit_code, reason=reason))
        if results[-1].status in DONE and not keep_checkpoints:
            _drop_checkpoints(cell, out)
    return results
