"""A torchrun worker of `trinity-train train` whose rank RANK dies (SIGKILL, as a lost GPU or
node would) right after it finishes optimizer step STEP (its checkpoint included), in the job's
first attempt only; torchrun then restarts every worker:

    torchrun ... tests/rank_dies.py RANK STEP train [--config FILE] [--key=value ...]
"""

from __future__ import annotations

import os
import signal
import sys

from trinity_train import cli
from trinity_train.callbacks import TrainerCallback
from trinity_train.checkpoint.manager import torchrun_restart_count


class DieAfterStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def after_iteration(self, trainer):
        if trainer.state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(rank: int, step: int, argv: list[str]) -> int:
    dies = int(os.environ["RANK"]) == rank and torchrun_restart_count() == 0
    return cli.main(argv, callbacks=[DieAfterStep(step)] if dies else None)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
