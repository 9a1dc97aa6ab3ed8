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
from trinity_train.checkpoint.manager import torchrun_restart_count
from trinity_train.train import Trainer


def main(rank: int, step: int, argv: list[str]) -> int:
    if int(os.environ["RANK"]) == rank and torchrun_restart_count() == 0:
        one_iteration = Trainer._one_iteration

        def dying_after_step(self, *args):
            one_iteration(self, *args)
            if self.state.step == step:
                os.kill(os.getpid(), signal.SIGKILL)

        Trainer._one_iteration = dying_after_step
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
