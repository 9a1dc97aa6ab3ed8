"""`trinity-train dashboard` and `trinity-train report`: argument checks, then the server or
the report."""

from __future__ import annotations

import sys
from pathlib import Path

from trinity_train.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RunDirArgumentError(UserError):
    """A RUN_DIR argument that cannot be a run directory."""

    exit_code = 2


def check_run_dirs(paths: list[str]) -> list[Path]:
    """The RUN_DIR arguments as paths. A path that does not exist yet is fine (a run that has not
    started: the page waits for it); a regular file is not."""
    for path in paths:
        if Path(path).exists() and not Path(path).is_dir():
            raise RunDirArgumentError(f"RUN_DIR '{path}' is a file, not a run directory: pass the run's directory "
                                      f"(its run.dir, which holds metrics.jsonl)")
    return [Path(p) for p in paths]


def host_warning(host: str) -> str | None:
    if host in LOOPBACK:
        return None
    return (f"warning: --host {host}: the dashboard is then reachable by others on the network, and it shows "
            "everything in these run directories (metrics, incident reports with document text); "
            "it has no login")


def run_dashboard(run_dirs: list[str], host: str, port: int) -> int:
    paths = check_run_dirs(run_dirs)
    from trinity_train.dashboard.server import DashboardServer

    if (warning := host_warning(host)) is not None:
        print(warning, file=sys.stderr)
    server = DashboardServer(paths, host=host, port=port)
    print(f"dashboard of {len(paths)} run(s) on {server.url} (Ctrl-C stops it)", flush=True)
    server.serve_forever()
    return 0


def run_report(run_dirs: list[str], out: str, title: str | None) -> int:
    paths = check_run_dirs(run_dirs)
    from trinity_train.dashboard.report import write_report

    written = write_report(paths, out, title=title)
    print(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB; opens offline in a browser)")
    return 0
