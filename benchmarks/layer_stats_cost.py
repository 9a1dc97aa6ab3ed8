"""What the per-layer statistics (`metrics.layer_stats_every`) cost, as a fraction of the step.

Side by side in one run: one Trainer on configs/debug.toml (the default model, corpus, Muon) runs
whole training iterations (`Trainer._one_iteration`: the step, its metrics records, all of it),
each timed; validation, checkpoints and console lines are off (they are not part of a step).

- interval 1 (statistics on every iteration): iterations with and without statistics alternate,
  and each statistics iteration is compared with the mean of its two neighbours;
- the configured interval k: rounds of k iterations, one of them a statistics iteration, which
  is compared with the median of the other k - 1 of its round; the cost is that over k.

The cost is the best statistics iteration over the best iteration without (as the other
benchmarks here report the best of several repetitions), and, beside it, the median of the
paired differences over the median iteration without statistics: a shared machine's load drifts
over seconds to minutes, so only iterations that ran next to each other are paired, and the
median keeps a load spike on one iteration from counting. The cost per iteration is that
difference divided by the interval.

    python benchmarks/layer_stats_cost.py [--pairs 20] [--rounds 8] [--a.b=value overrides...]

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
from dataclasses import dataclass, field
from pathlib import Path

from measure import timed
from trinity_train.config import load_config
from trinity_train.observe import MetricsRecorder
from trinity_train.train import Throughput, Trainer, TrainSummary

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "debug.toml"
# Nothing but training steps: no validation, checkpoints or console lines; a given peak, so no
# matmul probe at start.
QUIET = ["--train.eval_every=0", "--checkpoint.every=0", "--metrics.progress_bar=false",
         "--train.log_every=1000000000", "--metrics.peak_flops=1e12", "--train.steps=1000000000"]


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unavailable"


@dataclass
class IntervalCost:
    """What statistics every `interval` iterations cost: the times of the statistics iterations,
    of the iterations without, and the extra seconds of each statistics iteration over the
    iterations next to it."""

    interval: int
    stats_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    extra_s: list[float] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """Of the step, from the best iterations with and without statistics."""
        return (min(self.stats_s) - min(self.plain_s)) / self.interval / min(self.plain_s)

    @property
    def median_fraction(self) -> float:
        """Of the step, from the median paired difference."""
        return statistics.median(self.extra_s) / self.interval / statistics.median(self.plain_s)

    def line(self) -> str:
        best = (min(self.stats_s) - min(self.plain_s)) * 1e3
        return (f"layer_stats_every={self.interval:<4d} costs {100 * self.fraction:+6.2f} % of the step "
                f"(best: a statistics iteration adds {best:.1f} ms to {min(self.plain_s) * 1e3:.1f} ms; "
                f"median of {len(self.extra_s)} paired: {100 * self.median_fraction:+.2f} %, "
                f"{statistics.median(self.extra_s) * 1e3:.1f} ms to {statistics.median(self.plain_s) * 1e3:.1f} ms)")


@dataclass
class LayerStatsOverhead:
    """The measured cost at interval 1 and at the configured interval."""

    costs: list[IntervalCost]
    load: list[str] = field(default_factory=list)  # /proc/loadavg before and after

    @property
    def fraction(self) -> dict[int, float]:
        return {c.interval: c.fraction for c in self.costs}

    def lines(self) -> list[str]:
        return [c.line() for c in self.costs]


def measure_layer_stats_overhead(config: Path = DEFAULT_CONFIG, overrides: list[str] | None = None,
                                 pairs: int = 20, rounds: int = 8) -> LayerStatsOverhead:
    """Run the iterations described in the module docstring and return what they measured."""
    load = [load_average()]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(config, list(overrides or []) + QUIET + [f"--run.dir={run_dir}"])
        interval = cfg.metrics.layer_stats_every
        if interval < 1:
            raise SystemExit("metrics.layer_stats_every must be >= 1 to measure its cost")
        trainer = Trainer(cfg)
        recorder = MetricsRecorder(cfg, trainer.run_dir, start_step=0)
        throughput = Throughput(cfg, trainer.device, 1)
        summary = TrainSummary(trainer.run_dir, 0, 0, 0)
        collector = trainer.step_fn.layer_stats

        def iteration(every: int) -> tuple[bool, float]:
            """(took statistics, seconds) of the next iteration with statistics every `every`."""
            collector.every = every
            takes_stats = collector.due(trainer.state.iteration + 1)
            return takes_stats, timed(lambda: trainer._one_iteration(recorder, throughput, summary),
                                      trainer.device)[0]

        for every in (1, 0, 1, 0):  # warm-up: allocator, first statistics iterations
            iteration(every)
        every_one = IntervalCost(1)
        times = [iteration(k % 2)[1] for k in range(2 * pairs + 1)]  # off, on, off, ..., off
        every_one.plain_s, every_one.stats_s = times[0::2], times[1::2]
        every_one.extra_s = [times[i] - (times[i - 1] + times[i + 1]) / 2 for i in range(1, 2 * pairs, 2)]
        costs = [every_one]
        if interval > 1:
            every_k = IntervalCost(interval)
            while trainer.state.iteration % interval:  # start rounds right after a statistics iteration
                iteration(0)
            for _ in range(rounds):
                round_times = [iteration(interval) for _ in range(interval)]
                plain = [t for stats, t in round_times if not stats]
                every_k.plain_s += plain
                every_k.stats_s += [t for stats, t in round_times if stats]
                every_k.extra_s += [t - statistics.median(plain) for stats, t in round_times if stats]
            costs.append(every_k)
        recorder.close()
    load.append(load_average())
    return LayerStatsOverhead(costs, load)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--pairs", type=int, default=20, help="statistics iterations at interval 1")
    parser.add_argument("--rounds", type=int, default=8, help="statistics iterations at the configured interval")
    args, overrides = parser.parse_known_args(argv)
    print(f"# load: {load_average()}")
    result = measure_layer_stats_overhead(args.config, overrides, args.pairs, args.rounds)
    print(f"config: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config} "
          f"{' '.join(overrides)}")
    for line in result.lines():
        print(line)
    print(f"# load after: {result.load[-1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
