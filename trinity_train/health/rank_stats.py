"""Per-rank statistics (DESIGN §8 "Rank statistics and stragglers"): how long each rank's
iterations take, how much of that it computed and how much it waited, and which rank is the
straggler.

On every rank, each iteration is timed from the start of its data phase to the end of its step
phase (drawing the batch, the drills acting before the step, forward, backward, optimizer; not
validation or checkpoint saves, which the timeline accounts for):

- `iter_s`: its wall time;
- `compute_s`: the CPU time of the thread that runs the loop (`time.thread_time()`: all the
  serial work and its share of every parallel operator). A rank waiting in a collective blocks
  without CPU, and a rank descheduled on a loaded machine keeps the CPU time of its work, so
  other ranks' slowness and a shared machine's load do not count as this rank's compute (a
  clean run on an oversubscribed 2-core machine is not a straggler). The process's CPU time
  over its torch threads was the first definition: it also counts the background threads
  (gloo's, an async save's writer), and on 2 loaded cores its ratio between two identical ranks
  reached 1.3-2.1 in single reports against 1.07-1.14 for the loop's thread (the clean 300-step
  run of tests/test_rank_health.py; benchmarks/README.md section 14);
- `wait_s`: `max(0, iter_s - compute_s)`: waiting for the other ranks (and for the CPU);
- `data_s`: the data phase's wall time;
- `comm_exposed_s`: the wall time the loop's thread spent blocked in collectives' waits
  (`health.collective_waits`): the communication compute did not hide, part of `wait_s` (a rank
  waiting for a slower one waits inside a collective, so this is network plus the others'
  lateness; on one host mostly the lateness). On NCCL only the host's blocking (near zero).

On CUDA this is the host's view: CPU time spent launching kernels, plus whatever the host spins
while it waits for the device (a synchronising `.item()`); work the device does while the host
sleeps is not seen, so a rank slow on its GPU shows as every rank's wait, not as its own compute.
A rank slow on its host (data, the CPU, Python) is seen.

Every `metrics.rank_stats_every` iterations the ranks' means since the previous report go into
ONE all_gather of a six-float tensor over the world group (bounded by
`parallel.collective_timeout_s`); rank 0 writes them as a `ranks` record and judges them with
`health.straggler.StragglerRule` (a `straggler` event and a console notice per episode). At
start the ranks gather their host names once (the `rank_hosts` event). One process is a world of
one: the same records with lists of one, no collective. The cost is measured by
benchmarks/rank_stats_cost.py.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

from trinity_train.callbacks import TrainerCallback
from trinity_train.health.collective_waits import CollectiveWaits
from trinity_train.health.straggler import Straggler, StragglerRule
from trinity_train.records import EventName, Phase, event, ranks_record

FIELDS = ("iterations", "iter_s", "compute_s", "wait_s", "data_s", "comm_exposed_s")  # the gathered row, in order
DIGITS = 6  # seconds are written rounded to the microsecond


def gather_rows(row: torch.Tensor, timeout_s: float, distributed: bool = True) -> torch.Tensor:
    """Every rank's `row` (a 1-D tensor) stacked by rank: one all_gather over the world group that
    fails after `timeout_s` instead of waiting forever; `row[None]` in one process (or when not
    `distributed`: a one-process trainer inside a job of many)."""
    if not (distributed and dist.is_initialized() and dist.get_world_size() > 1):
        return row[None]
    out = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(out, row, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    return torch.stack(out)


def gather_hosts(distributed: bool = True) -> list[str]:
    """The host name of every rank, by rank (this one's alone when not `distributed`)."""
    mine = socket.gethostname()
    if not (distributed and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, mine)
    return hosts


class IterationTimes:
    """Sums of one rank's iteration times since the last report."""

    def __init__(self):
        self.iterations = 0
        self.iter_s = self.compute_s = self.wait_s = self.data_s = self.comm_exposed_s = 0.0

    def add(self, wall_s: float, compute: float, data_s: float, comm_exposed_s: float) -> None:
        self.iterations += 1
        self.iter_s += wall_s
        self.compute_s += compute
        self.wait_s += max(0.0, wall_s - compute)
        self.data_s += data_s
        self.comm_exposed_s += comm_exposed_s

    def means(self) -> list[float]:
        """[iterations, then each time's mean per iteration] (the gathered row)."""
        n = max(self.iterations, 1)
        return [float(self.iterations), self.iter_s / n, self.compute_s / n, self.wait_s / n, self.data_s / n,
                self.comm_exposed_s / n]


class RankStatsCallback(TrainerCallback):
    """A built-in of the trainer: times every iteration on every rank, gathers and records the
    means every `metrics.rank_stats_every` iterations (0: off) and flags stragglers."""

    def __init__(self, every: int, ratio: float, reports: int, timeout_s: float):
        self.every, self.timeout_s = every, timeout_s
        self.rule = StragglerRule(ratio, reports)
        self.times = IterationTimes()
        self.hosts: list[str] = []
        self.distributed = False  # the trainer's ranks are more than one (from `on_start`)
        self.waits = CollectiveWaits()  # installed from `on_start` to `on_end`
        self._started: tuple[float, float, float] | None = None  # (wall, thread CPU, waits) at the data phase's start
        self._data_s = 0.0

    @classmethod
    def for_config(cls, cfg) -> RankStatsCallback:
        m = cfg.metrics
        return cls(m.rank_stats_every, m.straggler_ratio, m.straggler_reports, cfg.parallel.collective_timeout_s)

    def on_start(self, trainer) -> None:
        if not self.every:
            return
        self.distributed = trainer.dims.is_distributed
        self.waits.install()
        self.hosts = gather_hosts(self.distributed)
        trainer.recorder.event(event(EventName.RANK_HOSTS, hosts=self.hosts))

    def phase_begin(self, trainer, phase) -> None:
        if self.every and phase == Phase.DATA:
            self._started = (time.perf_counter(), time.thread_time(), self.waits.seconds)

    def phase_end(self, trainer, phase, seconds) -> None:
        if phase == Phase.DATA:
            self._data_s = seconds
        elif phase == Phase.STEP and self._started is not None:
            wall, cpu, waited = self._started
            self.times.add(time.perf_counter() - wall, time.thread_time() - cpu, self._data_s,
                           self.waits.seconds - waited)
            self._started = None

    def after_iteration(self, trainer) -> None:
        if self.every and trainer.state.iteration % self.every == 0:
            self.report(trainer)

    def on_end(self, trainer, summary) -> None:
        self.waits.uninstall()

    def report(self, trainer) -> None:
        """Gather every rank's means since the last report (collective: every rank calls it at the
        same iteration); rank 0 records them and the stragglers they show."""
        with trainer.phase(Phase.STATISTICS):
            rows = gather_rows(torch.tensor(self.times.means(), dtype=torch.float64, device=trainer.device),
                               self.timeout_s, self.distributed).cpu()
        self.times = IterationTimes()
        iterations = int(rows[0, 0])
        if not trainer.is_main or not iterations:
            return
        state = trainer.state
        columns = {name: [round(v, DIGITS) for v in rows[:, i].tolist()] for i, name in enumerate(FIELDS) if i}
        trainer.recorder.ranks(ranks_record(iter=state.iteration, step=state.step, iterations=iterations, **columns))
        for found in self.rule.judge(columns["compute_s"]):
            self._flag(trainer, found)

    def _flag(self, trainer, found: Straggler) -> None:
        state = trainer.state
        host = self.hosts[found.rank] if found.rank < len(self.hosts) else None
        trainer.recorder.event(event(EventName.STRAGGLER, iter=state.iteration, step=state.step, rank=found.rank,
                                     host=host, compute_s=round(found.compute_s, DIGITS),
                                     median_s=round(found.median_s, DIGITS), ratio=round(found.ratio, 3),
                                     reports=found.reports))
        trainer.recorder.notice(
            f"iteration {state.iteration}: straggler: rank {found.rank} (host {host}) computes "
            f"{found.compute_s:.3g} s per iteration, {found.ratio:.1f}x the median of the other ranks "
            f"({found.median_s:.3g} s), {found.reports} reports in a row")
