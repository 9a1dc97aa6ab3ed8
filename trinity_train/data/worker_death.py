"""Local pipeline processes die with the `prepare-data` process that forked them.

datatrove's LocalPipelineExecutor.run forks a manager process (always: it holds the queue of
local ranks) and, for more than one worker, a pool of workers; none of them watches its parent,
so a prepare-data SIGKILLed mid-way (the OOM killer, `kill -9`) left them running, idle and
orphaned, each holding a copy of its memory. datatrove gives neither a start hook (its Pool gets
no initializer, its Manager none), so the hook is os.register_at_fork's: while
`children_die_with_this_process()` is entered, a child forked by this process asks the kernel for
a SIGKILL when its parent goes (prctl PR_SET_PDEATHSIG), then checks that the parent did not go
before it asked. The kernel's "parent" is the forking thread: datatrove forks the manager and the
pool from the thread that calls run(); the pool's own thread forks only replacements of a worker
that died, and ends (taking them) only when the pool does. Only forked children are reached: the
pool forks (executors.py asks for it) and so does the manager, from multiprocess's default start
method, fork on Linux before Python 3.14 (tests/test_data_prepare_executors.py would see a change).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_armed_by: int | None = None  # while armed: the pid whose forked children die with it
_prctl = None


def _after_fork_in_child() -> None:
    global _armed_by
    parent, _armed_by = _armed_by, None  # disarmed in the child: its own children are not ours
    if parent is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def children_die_with_this_process() -> Iterator[None]:
    """Children forked while entered are SIGKILLed when this process dies (Linux; elsewhere as is)."""
    global _armed_by, _prctl
    if not sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG is Linux's
        yield
        return
    if _prctl is None:  # resolved here: a just-forked child of a threaded process should not dlopen
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _armed_by = os.getpid()
    try:
        yield
    finally:
        _armed_by = None
