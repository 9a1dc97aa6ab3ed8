"""Run `trinity-train`, pausing right after optimizer step 1 until the file GATE exists: a run that
is surely alive (holding its run directory) while a test starts another one on it.

    python tests/paused_run.py GATE train [--config FILE] [--key=value ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trinity_train import cli
from trinity_train.callbacks import TrainerCallback


class PauseAfterStepOne(TrainerCallback):
    """Waits (bounded by the test's own timeout) at the end of step 1 until `gate` exists."""

    def __init__(self, gate: Path):
        self.gate = gate

    def after_iteration(self, trainer):
        while trainer.state.step == 1 and not self.gate.exists():
            time.sleep(0.05)


def main(gate: Path, argv: list[str]) -> int:
    return cli.main(argv, callbacks=[PauseAfterStepOne(gate)])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
