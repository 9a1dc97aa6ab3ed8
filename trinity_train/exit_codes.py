"""The process exit codes of `trinity-train` and its launchers, for the person and the scheduler
that read them (docs/reference/exit-codes.md): which endings to inspect, which to fix, which to requeue.

| code | name | meaning | a scheduler should |
|---|---|---|---|
| 0 | `DONE` | the run finished (or had nothing to do) | nothing |
| 1 | `FAILURE` | a failure to inspect: bad data, a damaged checkpoint, a bug | not requeue |
| 2 | `CONFIG` | a configuration or usage mistake: fix the command | not requeue |
| 3 | `DIVERGED` | the spike guard halted a diverged run | not requeue |
| 75 | `RESTARTABLE` | an infrastructure failure: a hang the watchdog caught, a lost peer | requeue |
| 130 | `INTERRUPTED` | stopped with Ctrl-C | not requeue |

75 is sysexits' EX_TEMPFAIL ("try again later"). Under torchrun a worker's 75 is restarted like
any other failure; the launcher (`launch/restarts.sh`) exits 75 itself when torchrun gave up and
the last attempt failed restartably (`launcher_verdict.mark_restartable`), so that a SLURM job
requeues on 75 only.
"""

from __future__ import annotations

DONE = 0
FAILURE = 1
CONFIG = 2
DIVERGED = 3
RESTARTABLE = 75  # EX_TEMPFAIL
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it

# What a scheduler may run again as it is: everything else needs a person first.
REQUEUE = frozenset({RESTARTABLE})
