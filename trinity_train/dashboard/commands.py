"""`trinity-train dashboard` and `trinity-train report`: argument checks, then the server or
the report."""

from __future__ import annotations

import sys
from pathlib import Path

from trinity_train.errors import ArgumentError, UserError
from trinity_train.files import disk_problem, output_file, user_path
from trinity_train.rundir import RunDir

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_run_dirs(paths: list[str]) -> list[Path]:
    """The RUN_DIR arguments as paths. A path that does not exist yet is fine (a run that has not
    started: the page waits for it); a regular file is not."""
    found = [user_path(p) for p in paths]
    for path in found:
        if path.exists() and not path.is_dir():
            raise ArgumentError(f"RUN_DIR '{path}' is a file, not a run directory: pass the run's directory "
                                f"(its run.dir, which holds metrics.jsonl)")
    return found


def check_report_paths(run_dirs: list[str], out: str) -> tuple[list[Path], Path]:
    """A report is of runs that exist (a live dashboard may wait for one; a file cannot), and its
    --out names a file whose directory can be made."""
    paths = [RunDir(user_path(p)).required().path for p in run_dirs]
    return paths, output_file(out, "--out", "report.html")


def host_warning(host: str) -> str | None:
    if host in LOOPBACK:
        return None
    return (f"warning: --host {host}: the dashboard is then reachable by others on the network, and it shows "
            "everything in these run directories (metrics, incident reports with document text); "
            "it has no login")


def run_dashboard(run_dirs: list[str], host: str, port: int) -> int:
    paths = check_run_dirs(run_dirs)
    if not 0 <= port <= 65535:
        raise ArgumentError(f"--port {port}: a port is a number from 0 to 65535 (0 = any free port)")
    from trinity_train.dashboard.server import DashboardServer

    if (warning := host_warning(host)) is not None:
        print(warning, file=sys.stderr)
    server = DashboardServer(paths, host=host, port=port)
    print(f"dashboard of {len(paths)} run(s) on {server.url} (Ctrl-C stops it)", flush=True)
    server.serve_forever()
    return 0


def run_report(run_dirs: list[str], out: str, title: str | None) -> int:
    paths, out_path = check_report_paths(run_dirs, out)
    from trinity_train.dashboard.report import write_report

    try:
        written = write_report(paths, out_path, title=title)
    except OSError as e:
        problem = disk_problem({e.errno} if e.errno is not None else set(), out_path, elsewhere="--out")
        if problem is None:
            raise
        raise UserError(f"could not write the report '{out_path}': {problem}") from None
    print(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB; opens offline in a browser)")
    return 0
