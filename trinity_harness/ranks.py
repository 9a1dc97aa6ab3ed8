"""Run a function on N gloo ranks on this machine, started the way torchrun starts them.

The one process-spawn harness of the tests and benchmarks:
`run_ranks(n, fn, *args)` spawns n processes with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free port), calls `fn(*args)` in each and returns
what they return, by rank. A failure in any rank raises in the caller with that rank's traceback;
ranks still running after `timeout_s` (a collective that hangs) are killed and the call fails, so
a hang never blocks the suite. `fn` must be importable (a module-level function).

`RankPool(n)` does the same with n ranks spawned once and kept: each `.run(fn, *args)` is one
job on ranks that have already imported torch and joined the gloo group (a fresh spawn costs
seconds of interpreter start per rank on a 2-core machine; the suite runs dozens of jobs). A
job that fails or hangs in any rank ends the pool's processes (the others may be stuck in a
collective with it); the next job spawns new ones. Jobs join the group through `init_gloo()`,
which is a no-op there, and never leave it.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
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
    """Join the process group from the environment `run_ranks` set (already joined in a pool)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)


def rank_trainer(cfg, callbacks: list | None = None):
    """The Trainer of `cfg` (a `config.Config`) on this rank, joined to the gloo group, its model
    split over the ranks as the config's layout says, as `train.train` builds it."""
    import functools

    from trinity_train.parallel.node_layout import layout_on_nodes
    from trinity_train.parallel.process_group import nodes_from_env
    from trinity_train.train import Trainer, build_model_for_training

    init_gloo()
    dims = layout_on_nodes(cfg, dist.get_world_size(), nodes_from_env(cfg))
    dims.build_mesh("cpu")
    return Trainer(cfg, dims, torch.device("cpu"), model_builder=functools.partial(build_model_for_training, dims=dims),
                   callbacks=callbacks)


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    """A pool rank: run the jobs from `tasks` until told to stop (None), reporting each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_gloo()
    try:
        while (job := tasks.get()) is not None:
            fn, args, out = job
            try:
                torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
                results.put((rank, dist.distributed_c10d.get_pg_count()))
            except BaseException:  # reported in the caller, which ends the pool
                results.put((rank, traceback.format_exc()))
        leave_together()
    finally:
        destroy_distributed()


# Process groups a pool's ranks may hold before they are replaced by fresh ones: every DeviceMesh
# dimension a job builds is one, each with a gloo thread that keeps polling after the job (a few
# per cent of a core per rank once dozens have piled up), and torch offers no list of them to
# destroy safely (code under test caches its own).
MAX_GROUPS = 16


class RankPool:
    def __init__(self, world: int):
        self.world = world
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, self.world, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world)]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
        if not self._procs:
            self._start()
        with tempfile.TemporaryDirectory() as out_dir:
            for queue in self._tasks:
                queue.put((fn, args, out_dir))
            deadline, done, groups = time.monotonic() + timeout_s, 0, 0
            while done < self.world:
                try:
                    rank, reply = self._results.get(timeout=2)  # a traceback, or its process group count
                except queue_module.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close(kill=True)
                        if dead:
                            raise RuntimeError(f"rank {dead[0]} of the {self.world}-rank pool died in "
                                               f"{fn.__name__}") from None
                        raise RanksHung(f"{self.world} ranks of {fn.__name__} still running after "
                                        f"{timeout_s:.0f}s: a collective hung") from None
                    continue
                if isinstance(reply, str):
                    self.close(kill=True)
                    raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{reply}")
                groups, done = max(groups, reply), done + 1
            results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(self.world)]
        if groups > MAX_GROUPS:
            self.close()  # the next job starts fresh ranks
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: together (leaving the group cleanly) or, after a failure, at once."""
        if not kill:
            for queue in self._tasks:
                queue.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []
