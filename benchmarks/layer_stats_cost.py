"""What the per-layer statistics (`metrics.layer_stats_every`) cost, as a fraction of the step.

Side by side in one run: one Trainer on configs/debug.toml (the default model, corpus, Muon) runs
whole training iterations (`Trainer.train_one_iteration`: the step, its metrics records, all of it),
each timed; validation, checkpoints and console lines are off (they are not part of a step).

- interval 1 (statistics on every iteration): iterations with and without statistics alternate,
  and each statistics iteration is compared with the mean of its two neighbours;
- the configured interval k: rounds of k iterations, one of them a statistics iteration, which
  is compared with the median of the other k - 1 of its round; the cost is that over k.

The cost is the median of those paired differences, divided by the interval, over the median
iteration without statistics (quartiles beside it): a shared machine's load drifts over seconds
to minutes, so only iterations that ran next to each other are paired, and the median keeps a
load spike on one iteration from counting (a best-of-N comparison does not: the best iterations
with and without statistics fall on different moments of the load). Both in wall-clock time
and, on a CPU, in this process's CPU time (all threads), which other processes' load changes
less.

    python benchmarks/layer_stats_cost.py [--pairs 20] [--rounds 12] [--a.b=value overrides...]

`measure_layer_stats_overhead(...)` is the same measurement for other benchmarks to print.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads spinning at barriers stall each operator
# (benchmarks/README.md). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from measure import synchronize
from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_train.config import load_config
from trinity_train.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "debug.toml"
# Nothing but training steps: no validation, checkpoints or console lines; a given peak, so no
# matmul probe at start.
QUIET = ["--eval.every=0", "--checkpoint.every=0", "--metrics.progress_bar=false",
         "--train.log_every=1000000000", "--metrics.peak_flops=1e12", "--train.steps=1000000000",
         "--stability.rollback_after=0"]  # no checkpoints to roll back to: say nothing of it


@dataclass
class Samples:
    """Seconds on one clock: of the statistics iterations, of the others, and each statistics
    iteration's extra over the iterations next to it."""

    stats: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    extra: list[float] = field(default_factory=list)

    def fractions(self, interval: int) -> list[float]:
        """Each paired difference spread over the interval, as a fraction of the median step."""
        return [e / interval / statistics.median(self.plain) for e in self.extra]

    def fraction(self, interval: int) -> float:
        return statistics.median(self.fractions(interval))

    def cells(self, interval: int) -> list[str]:
        """The table's figures: share of the step, its quartiles, ms a statistics iteration adds,
        the plain step's ms, how many samples."""
        fractions = self.fractions(interval)
        low, _, high = statistics.quantiles(fractions, n=4) if len(fractions) > 1 else fractions * 3
        return [f"{100 * self.fraction(interval):+.2f}", f"{100 * low:+.2f} .. {100 * high:+.2f}",
                f"{statistics.median(self.extra) * 1e3:.1f}", f"{statistics.median(self.plain) * 1e3:.1f}",
                str(len(self.extra))]


# Wall-clock time, and on a CPU this process's CPU time (all its threads), which other processes'
# load changes far less: on a shared machine the steadier of the two.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class IntervalCost:
    """What statistics every `interval` iterations cost, by clock."""

    interval: int
    clocks: dict[str, Samples]

    @property
    def fraction(self) -> float:
        """Of the step's wall-clock time."""
        return self.clocks["wall"].fraction(self.interval)

    def rows(self) -> list[list[str]]:
        names = {"wall": "wall clock", "cpu": "CPU time"}
        return [[str(self.interval), names[clock], *samples.cells(self.interval)]
                for clock, samples in self.clocks.items()]


@dataclass
class LayerStatsOverhead:
    """The measured cost at interval 1 and at the configured interval."""

    costs: list[IntervalCost]
    load: list[str] = field(default_factory=list)  # /proc/loadavg before and after

    @property
    def fraction(self) -> dict[int, float]:
        return {c.interval: c.fraction for c in self.costs}

    HEADERS = ["layer_stats_every", "clock", "% of the step (median)", "quartiles, %",
               "ms a statistics iteration adds", "step ms without", "samples"]

    def table(self) -> str:
        return markdown_table(self.HEADERS, [row for c in self.costs for row in c.rows()])


def measure_layer_stats_overhead(config: Path = DEFAULT_CONFIG, overrides: list[str] | None = None,
                                 pairs: int = 20, rounds: int = 12) -> LayerStatsOverhead:
    """Run the iterations described in the module docstring and return what they measured."""
    load = [loadavg()]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(config, list(overrides or []) + QUIET + [f"--run.dir={run_dir}"])
        interval = cfg.metrics.layer_stats_every
        if interval < 1:
            raise SystemExit("metrics.layer_stats_every must be >= 1 to measure its cost")
        trainer = Trainer(cfg)
        trainer.start()
        collector = trainer.step_fn.layer_stats
        clocks = CLOCKS if trainer.device.type == "cpu" else {"wall": CLOCKS["wall"]}

        def iteration(every: int) -> tuple[bool, dict[str, float]]:
            """(took statistics, seconds by clock) of the next iteration with statistics every `every`."""
            collector.every = every
            takes_stats = collector.due(trainer.state.iteration + 1)
            synchronize(trainer.device)
            start = {name: clock() for name, clock in clocks.items()}
            trainer.train_one_iteration()
            synchronize(trainer.device)
            return takes_stats, {name: clock() - start[name] for name, clock in clocks.items()}

        for every in (1, 0, 1, 0):  # warm-up: allocator, first statistics iterations
            iteration(every)
        every_one = IntervalCost(1, {name: Samples() for name in clocks})
        runs = [iteration(k % 2)[1] for k in range(2 * pairs + 1)]  # off, on, off, ..., off
        for name, samples in every_one.clocks.items():
            times = [r[name] for r in runs]
            samples.plain, samples.stats = times[0::2], times[1::2]
            samples.extra = [times[i] - (times[i - 1] + times[i + 1]) / 2 for i in range(1, 2 * pairs, 2)]
        costs = [every_one]
        if interval > 1:
            every_k = IntervalCost(interval, {name: Samples() for name in clocks})
            while trainer.state.iteration % interval:  # start rounds right after a statistics iteration
                iteration(0)
            for _ in range(rounds):
                runs_k = [iteration(interval) for _ in range(interval)]
                for name, samples in every_k.clocks.items():
                    plain = [t[name] for stats, t in runs_k if not stats]
                    took = [t[name] for stats, t in runs_k if stats]
                    samples.plain += plain
                    samples.stats += took
                    samples.extra += [t - statistics.median(plain) for t in took]
            costs.append(every_k)
        trainer.finish()
    load.append(loadavg())
    return LayerStatsOverhead(costs, load)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--pairs", type=int, default=20, help="statistics iterations at interval 1")
    parser.add_argument("--rounds", type=int, default=12, help="statistics iterations at the configured interval")
    args, overrides = parser.parse_known_args(argv)
    print(f"# load: {loadavg()}")
    result = measure_layer_stats_overhead(args.config, overrides, args.pairs, args.rounds)
    print(f"config: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config} "
          f"{' '.join(overrides)}")
    print(f"# load after: {result.load[-1]}")
    print(result.table())


if __name__ == "__main__":
    main(sys.argv[1:])
