"""A user mistake under the launchers ends the job instead of being restarted.

torchrun restarts every worker whose process fails, which is right for a lost node or a collective
timeout and wrong for a mistake the user has to fix (a config the nodes disagree on, a checkpoint
that does not fit): each restart would fail the same way and bury the one line that says why
under torchrun's failure reports. The launchers (`launch/restarts.sh`) give every worker a folder
in TRINITY_LAUNCHER_VERDICT; a worker that meets a UserError writes its exit code and one-line
message there and exits 0, so torchrun does not restart it, and the launcher prints the line of
the lowest rank and exits with that code (2 for configuration, 1 otherwise; never the restartable
codes a scheduler requeues on).
"""

from __future__ import annotations

import os
from pathlib import Path

VERDICT_ENV = "TRINITY_LAUNCHER_VERDICT"


def hand_to_launcher(exit_code: int, message: str) -> bool:
    """Leave (exit_code, message) for the launcher; True when a launcher takes it, so the
    process exits 0 and prints nothing itself."""
    folder = os.environ.get(VERDICT_ENV)
    if not folder or "RANK" not in os.environ or not Path(folder).is_dir():
        return False
    rank = int(os.environ["RANK"])
    path = Path(folder) / f"rank{rank:06d}"
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(f"{exit_code}\t{message}\n")
    temp.replace(path)  # the launcher reads a whole line or none
    return True
