"""What the rank statistics (`metrics.rank_stats_every`) cost, as a fraction of the step.

Side by side in one run on 2 gloo ranks of this machine (trinity_harness/ranks.py; one OpenMP thread each):
both ranks build one Trainer (configs/debug.toml with a smaller batch by default, so a round is
seconds, not a minute) and run rounds of k = `metrics.rank_stats_every` whole training
iterations (`Trainer.train_one_iteration`), alternately with the rank statistics on (every
iteration timed, one all_gather and one `ranks` record at the round's last iteration) and off
(the callback idle), in the order on-off, off-on, ... so a drift of the load favours neither.
Each pair's difference is the cost of one report and its k timed iterations; spread over k and
divided by the median iteration without statistics it is the fraction of the step. Median and
quartiles of the pairs, in rank 0's wall-clock and CPU time, with /proc/loadavg before and after.

On a loaded machine the pairs scatter by far more than the cost, so the parts are also timed
directly: the statistics phase of each report on rank 0 (the gather, waiting for the other rank
included, and the record), and the timing the callback adds to every iteration (its phase hooks,
called a million times); and the exposed-communication timing (health/collective_waits.py): the
waits rank 0 timed per iteration times what timing one wait adds (a million calls of a timed
no-op against the bare no-op), beside the exposed seconds it measured.

    python benchmarks/rank_stats_cost.py [--pairs 12] [--a.b=value overrides...]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as layer_stats_cost.py: no spinning threads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from layer_stats_cost import CLOCKS, DEFAULT_CONFIG, QUIET, ROOT, Samples  # noqa: E402
from trinity_harness.jobs import loadavg  # noqa: E402
from trinity_harness.ranks import rank_trainer, run_ranks  # noqa: E402
from trinity_harness.table import markdown_table  # noqa: E402
from trinity_train.config import load_config  # noqa: E402
from trinity_train.callbacks import TrainerCallback  # noqa: E402
from trinity_train.health.collective_waits import CollectiveWaits, timed_wait  # noqa: E402
from trinity_train.health.rank_stats import RankStatsCallback  # noqa: E402
from trinity_train.records import Phase  # noqa: E402

# A debug-model step of about a second on 2 shared cores: 2 x 128 tokens per rank.
SMALLER = ["--train.micro_batch_size=2", "--data.seq_len=128", "--metrics.layer_stats_every=0"]


class StatisticsPhases(TrainerCallback):
    """The seconds of every statistics phase (one per report)."""

    def __init__(self):
        self.seconds: list[float] = []

    def phase_end(self, trainer, phase, seconds):
        if phase == Phase.STATISTICS:
            self.seconds.append(seconds)


def hook_seconds(calls: int = 1_000_000) -> float:
    """Seconds the rank statistics add to one iteration outside a report: their four phase hooks."""
    stats = RankStatsCallback(every=10**9, ratio=1.5, reports=3, timeout_s=60)
    trainer = SimpleNamespace()
    start = time.perf_counter()
    for _ in range(calls):
        stats.phase_begin(trainer, Phase.DATA)
        stats.phase_end(trainer, Phase.DATA, 0.0)
        stats.phase_begin(trainer, Phase.STEP)
        stats.phase_end(trainer, Phase.STEP, 0.0)
    return (time.perf_counter() - start) / calls


def wait_timing_seconds(calls: int = 1_000_000) -> float:
    """Seconds timing one collective wait adds to it: a timed no-op (charged to an installed
    `CollectiveWaits` of this thread, as in training) against the bare no-op."""
    def noop():
        return None

    def per_call(wait) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            wait()
        return (time.perf_counter() - start) / calls

    with CollectiveWaits():
        return per_call(timed_wait(noop)) - per_call(noop)


def _rounds(config: Path, overrides: list[str], pairs: int, run_dir: str) -> tuple | None:
    """On each rank: the rounds of the module docstring; rank 0 returns its samples by clock and
    the seconds of its statistics phases."""
    cfg = load_config(config, overrides + QUIET + [f"--run.dir={run_dir}"])
    every = cfg.metrics.rank_stats_every
    if every < 1:
        raise SystemExit("metrics.rank_stats_every must be >= 1 to measure its cost")
    phases = StatisticsPhases()
    trainer = rank_trainer(cfg, callbacks=[phases])
    trainer.start()
    (stats,) = [c for c in trainer.callbacks.callbacks if isinstance(c, RankStatsCallback)]

    def round_of(on: bool) -> dict[str, float]:
        stats.every = every if on else 0
        start = {name: clock() for name, clock in CLOCKS.items()}
        for _ in range(every):
            trainer.train_one_iteration()
        return {name: clock() - start[name] for name, clock in CLOCKS.items()}

    round_of(True), round_of(False)  # warm-up: allocator, the first report
    phases.seconds.clear()
    waits_before = (stats.waits.calls, stats.waits.seconds)
    samples = {name: Samples() for name in CLOCKS}
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        times = dict(zip(order, (round_of(on) for on in order)))
        for name, s in samples.items():
            s.plain.append(times[False][name] / every)
            s.stats.append(times[True][name] / every)
            s.extra.append(times[True][name] - times[False][name])
    iterations = 2 * pairs * every
    waits = ((stats.waits.calls - waits_before[0]) / iterations,
             (stats.waits.seconds - waits_before[1]) / iterations)
    trainer.finish()
    return (samples, phases.seconds, waits) if trainer.is_main else None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--pairs", type=int, default=12, help="on/off pairs of rounds")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--full-batch", action="store_true", help="the config's own batch (default: 2 x 128 tokens)")
    args, overrides = parser.parse_known_args(argv)
    overrides = ([] if args.full_batch else SMALLER) + overrides
    before = loadavg()
    with tempfile.TemporaryDirectory() as run_dir:
        samples, phases, (waits, exposed_s) = run_ranks(args.ranks, _rounds, args.config, overrides, args.pairs,
                                                        run_dir, timeout_s=3600)[0]
    every = load_config(args.config, overrides).metrics.rank_stats_every
    print(f"# load: {before}")
    print(f"config: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config} "
          f"{' '.join(overrides)} on {args.ranks} gloo ranks")
    step = statistics.median(samples["wall"].plain)
    report, hooks = statistics.median(phases), hook_seconds()
    per_wait = wait_timing_seconds()
    print(f"# load after: {loadavg()}")
    rows = [[f"{every}", "wall clock (paired rounds)", *samples["wall"].cells(every), ""],
            [f"{every}", "CPU time (paired rounds)", *samples["cpu"].cells(every), ""],
            [f"{every}", "timed directly", f"{100 * (report / every + hooks) / step:.3f}", "-", f"{report * 1e3:.2f}",
             f"{step * 1e3:.1f}", f"{len(phases)}",
             f"a report's statistics phase (max {max(phases) * 1e3:.2f} ms) "
             f"+ the hooks {hooks * 1e6:.1f} us per iteration"],
            [f"{every}", "exposed communication timing", f"{100 * waits * per_wait / step:.4f}", "-",
             f"{waits * per_wait * 1e3:.4f}", f"{step * 1e3:.1f}", "-",
             f"{waits:.0f} waits timed per iteration x {per_wait * 1e6:.2f} us (it measured {exposed_s * 1e3:.1f} ms "
             f"exposed per iteration on rank 0)"]]
    print(markdown_table(["rank_stats_every", "measured by", "% of the step (median)", "quartiles, %",
                          "ms added (a report iteration; per iteration for the timing)", "step ms", "samples",
                          "detail"],
                         rows))

if __name__ == "__main__":
    main(sys.argv[1:])
