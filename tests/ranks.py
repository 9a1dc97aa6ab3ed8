"""Run a function on N gloo ranks on this machine, started the way torchrun starts them.

The one process-spawn harness of the tests and benchmarks (benchmarks put this directory on
their path): `run_ranks(n, fn, *args)` spawns n processes with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free port), calls `fn(*args)` in each and returns
what they return, by rank. A failure in any rank raises in the caller with that rank's traceback;
ranks still running after `timeout_s` (a collective that hangs) are killed and the call fails, so
a hang never blocks the suite. `fn` must be importable (a module-level function).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trinity_train.parallel.process_group import destroy_distributed, leave_together

DEFAULT_TIMEOUT_S = 300.0
# A collective that waits longer than this in a rank fails there (gloo's default is 30 minutes).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


class RanksHung(RuntimeError):
    """Ranks still ran when the deadline passed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        leave_together()
    finally:
        destroy_distributed()


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=2):  # raises with the rank's traceback when one fails
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise RanksHung(f"{world} ranks of {fn.__name__} still running after {timeout_s:.0f}s: "
                                "a collective hung")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def init_gloo() -> None:
    """Join the process group from the environment `run_ranks` set."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
