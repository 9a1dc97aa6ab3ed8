"""`python -m trinity_harness.train_instrumented train ARGS`: `trinity-train train ARGS` in a
rank that first installs the instruments its environment asks for (`instruments.COUNTER_ENV`: the
collective counter; `instruments.WAITS_ENV`: the collective waits by site), each writing into the
folder the variable names. A benchmark launches such a job with the launchers' own command and
`TRAIN_MODULE=trinity_harness.train_instrumented` in its environment (`jobs.instrumented_env`):
launch/local.sh and launch/multinode.sh start `python -m $TRAIN_MODULE` (default trinity_train.cli).
"""

from __future__ import annotations

import os
import sys

from trinity_harness.instruments import COUNTER_ENV, WAITS_ENV, install_collective_counter, install_wait_profiler


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(COUNTER_ENV):
        install_collective_counter(os.environ[COUNTER_ENV])
    if os.environ.get(WAITS_ENV):
        install_wait_profiler(os.environ[WAITS_ENV])
    from trinity_train.cli import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
