"""`python -m trinity_harness.train_instrumented train ARGS`: `trinity-train train ARGS` in a
rank that first installs the instruments its environment asks for (`instruments.COUNTER_ENV`: the
collective counter; `instruments.WAITS_ENV`: the collective waits by site), each writing into the
folder the variable names, and runs a CPU job's overlaps as `GLOO_OVERLAP_ENV` says (an
ablation's: "none", or a comma-separated subset of "reduce_scatter,all_gather"; unset: all). A benchmark launches such a job with the launchers' own command and
`TRAIN_MODULE=trinity_harness.train_instrumented` in its environment (`jobs.instrumented_env`):
launch/local.sh and launch/multinode.sh start `python -m $TRAIN_MODULE` (default trinity_train.cli).
"""

from __future__ import annotations

import os
import sys

from trinity_harness.instruments import COUNTER_ENV, WAITS_ENV, install_collective_counter, install_wait_profiler


GLOO_OVERLAP_ENV = "TRINITY_HARNESS_GLOO_OVERLAP"


def gloo_overlap(setting: str | None):
    """`GlooOverlap` with the overlaps `setting` names on (None: every one, the trainer's default)."""
    from trinity_train.parallel.gloo.communication import GlooOverlap

    if setting is None:
        return None
    on = set() if setting == "none" else set(setting.split(","))
    unknown = on - {"reduce_scatter", "all_gather"}
    if unknown:
        raise ValueError(f"{GLOO_OVERLAP_ENV}: unknown overlaps {sorted(unknown)}")
    return GlooOverlap(reduce_scatter="reduce_scatter" in on, all_gather="all_gather" in on)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(COUNTER_ENV):
        install_collective_counter(os.environ[COUNTER_ENV])
    if os.environ.get(WAITS_ENV):
        install_wait_profiler(os.environ[WAITS_ENV])
    from trinity_train.cli import main as train_main

    return train_main(argv, gloo_overlap=gloo_overlap(os.environ.get(GLOO_OVERLAP_ENV)))


if __name__ == "__main__":
    sys.exit(main())
