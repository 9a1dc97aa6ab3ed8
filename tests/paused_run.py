"""Run `trinity-train`, pausing right after optimizer step 1 until the file GATE exists: a run that
is surely alive (holding its run directory) while a test starts another one on it.

    python tests/paused_run.py GATE train [--config FILE] [--key=value ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trinity_train import cli
from trinity_train.train import Trainer


def main(gate: Path, argv: list[str]) -> int:
    one_iteration = Trainer._one_iteration

    def pausing_after_step_one(self, *args):
        one_iteration(self, *args)
        while self.state.step == 1 and not gate.exists():
            time.sleep(0.05)

    Trainer._one_iteration = pausing_after_step_one
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
