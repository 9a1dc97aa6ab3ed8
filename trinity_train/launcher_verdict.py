"""What a worker tells the launcher about how it ended, beyond its exit status (DESIGN §4).

A user mistake ends the job instead of being restarted. torchrun restarts every worker whose
process fails, which is right for a lost node or a collective timeout and wrong for a mistake the
user has to fix (a config the nodes disagree on, a checkpoint that does not fit): each restart
would fail the same way and bury the one line that says why under torchrun's failure reports.
The launchers (`launch/restarts.sh`) give every worker a folder in TRINITY_LAUNCHER_VERDICT; a
worker that meets a UserError writes its exit code and one-line message there and exits 0, so
torchrun does not restart it, and the launcher prints the line of the lowest rank and exits with
that code (`exit_codes`: 2 for configuration, 3 diverged, 1 otherwise; never the restartable code
a scheduler requeues on).

A restartable failure (the hang watchdog, a lost peer) is the opposite: the worker exits
`exit_codes.RESTARTABLE` and torchrun restarts the job, and when torchrun has no restart left
the launcher must still say "restartable" to the scheduler, which torchrun's own exit status (1
for any failure) does not. So the worker also leaves `restartable-<attempt>-rank<RANK>` there
(`<message>`), and the launcher exits 75 when its last attempt left one.
"""

from __future__ import annotations

import os
from pathlib import Path

VERDICT_ENV = "TRINITY_LAUNCHER_VERDICT"
RESTARTABLE_PREFIX = "restartable-"  # launch/restarts.sh looks for restartable-<attempt>-*


def _launcher_file(name: str, text: str) -> bool:
    """Write `text` to `name` in the launcher's folder, whole or not at all; False outside one."""
    folder = os.environ.get(VERDICT_ENV)
    if not folder or "RANK" not in os.environ or not Path(folder).is_dir():
        return False
    path = Path(folder) / name
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text)
    temp.replace(path)  # the launcher reads a whole line or none
    return True


def hand_to_launcher(exit_code: int, message: str) -> bool:
    """Leave (exit_code, message) for the launcher; True when a launcher takes it, so the
    process exits 0 and prints nothing itself."""
    return _launcher_file(f"rank{int(os.environ.get('RANK', 0)):06d}", f"{exit_code}\t{message}\n")


def restartable_marker_name(attempt: int, rank: int) -> str:
    return f"{RESTARTABLE_PREFIX}{attempt}-rank{rank:06d}"


def mark_restartable(message: str) -> bool:
    """Tell the launcher this worker's failure in this torchrun attempt is restartable (it still
    exits non-zero, so torchrun restarts the job); True when a launcher is there to read it."""
    try:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        attempt = 0
    return _launcher_file(restartable_marker_name(attempt, int(os.environ.get("RANK", 0))), message + "\n")
