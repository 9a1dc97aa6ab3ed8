"""Exposed communication: the seconds a thread spends blocked waiting for collectives (DESIGN §8
"Rank statistics and stragglers"; the `ranks` records' `comm_exposed_s`).

Every collective of a step ends, for the thread that issued it, in one of two waits:

- `Work.wait()` (torch._C._distributed_c10d.Work): a synchronous `torch.distributed` call
  (`all_reduce`, `all_gather_single`, `all_to_all_single`, ... , and so FSDP2's all-gathers and
  our reduce-scatter, parallel/gloo/reduce_scatter.py) waits on its work object before it
  returns, and an asynchronous one (`async_op=True`: FSDP2's prefetch, Muon's packed exchange in
  optim/muon_exchange.py) is waited by its caller;
- `_functional_collectives.wait_tensor` (functional collectives: DTensor's redistribute, which
  Muon's round-by-round path uses, and the EP all-to-all, parallel/expert_parallel.py): the first use of an
  `AsyncCollectiveTensor`, and the backward of the autograd collectives, wait through that module
  function.

`CollectiveWaits` wraps both while it is installed and adds the wall time of each wait made on
the thread that installed it (the training loop's) to `seconds`. Time a collective ran while the
thread computed is not counted: only what compute did not hide. Waits on other threads (an async
checkpoint's writer) are not this thread's exposure and are passed through untimed. The wrappers
are torch's own entry points looked up at call time (a caller reaching `torch.ops.c10d...` or
`torch.ops._c10d_functional.wait_tensor` directly, none in this repository or FSDP2/DTensor's
eager paths, is not seen). Inside a graph torch.compile traces, the waits are torch's own,
untimed (a `block.compile()` run times the waits its eager parts make).

On gloo (CPU) the collective runs on gloo's threads, so the blocked time is the exposed time. On
NCCL a wait only orders the CUDA streams and returns at once: the field is the host's blocking,
near zero, and the exposure shows up later, where the host synchronises with the device. The
overhead is two clock reads and a thread check per wait (benchmarks/rank_stats_cost.py measures
it per step).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import Work

_lock = threading.Lock()
_active: list[CollectiveWaits] = []  # installed instances, the latest last
_originals: dict[str, object] = {}  # what the wrappers replaced, while any instance is installed


def _charge(seconds: float, caller: FrameType) -> None:
    me = threading.get_ident()
    for waits in _active:
        if waits.thread == me:
            waits.seconds += seconds
            waits.calls += 1
            if waits.on_wait is not None:
                waits.on_wait(seconds, caller)


def timed_wait(wait):
    """`wait` (a function) timed: each call's wall time is charged to the calling thread's
    installed `CollectiveWaits` (none: to nobody)."""
    def timed(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into a graph: torch's own wait, no clock in it
            return wait(*args, **kwargs)
        start = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            _charge(time.perf_counter() - start, sys._getframe(1))
    return timed


class CollectiveWaits:
    """Seconds the installing thread has waited in collectives while installed (`seconds` and
    the count of waits, `calls`, only grow; read them before and after a span). Installs
    process-wide wrappers shared by every instance and removed with the last one; use as a
    context manager or `install`/`uninstall`. `on_wait(seconds, caller's frame)`, if given, is
    called after each wait charged to it (a profiler that names where the thread waits)."""

    def __init__(self, on_wait: Callable[[float, FrameType], None] | None = None):
        self.thread: int | None = None
        self.seconds = 0.0
        self.calls = 0  # the waits timed
        self.on_wait = on_wait

    def install(self) -> CollectiveWaits:
        with _lock:
            if self in _active:
                return self
            self.thread = threading.get_ident()
            if not _active:
                _originals.update(work_wait=Work.wait, wait_tensor=funcol.wait_tensor)
                Work.wait = timed_wait(Work.wait)
                funcol.wait_tensor = timed_wait(funcol.wait_tensor)
            _active.append(self)
        return self

    def uninstall(self) -> None:
        with _lock:
            if self not in _active:
                return
            _active.remove(self)
            if not _active:
                Work.wait = _originals.pop("work_wait")
                funcol.wait_tensor = _originals.pop("wait_tensor")

    def __enter__(self) -> CollectiveWaits:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
