"""What the hang watchdog and its heartbeat (`[watchdog]`, trinity_train/health/) cost, as a
fraction of the step.

Side by side in one run: one Trainer on configs/debug.toml (the default model, corpus, Muon) runs
whole training iterations (`Trainer.train_one_iteration`), each timed, with the watchdog on and
off alternately (off, on, off, ..., off); each "on" iteration is paired with the mean of its two
neighbours and the cost is the median of those differences over the median "off" iteration, in
wall-clock and CPU time (as benchmarks/layer_stats_cost.py pairs, for the same reason: a shared
machine's load drifts). "On" is what every run pays: the phase hooks on the loop's thread, and
the watchdog's thread waking every tick, publishing the heartbeat to a c10d TCPStore served in
this process (a distributed job's store is across a network: see the store figure) and checking
the clock. "Off" has no thread and no hooks.

Beside it, the parts by themselves, which bound what the pairing cannot resolve under load: the
loop thread's cost per phase entry (`Watchdog.enter`), one heartbeat publication (`TCPStore.set`,
on the watchdog's thread, at most once per tick), and the watchdog thread's CPU time per wake-up
(the process's CPU time over a few seconds with the thread running and not, alternately, while
the main thread only sleeps and enters a phase every 10 ms).

    python benchmarks/watchdog_cost.py [--pairs 15] [--a.b=value overrides...]
"""

from __future__ import annotations

import os

# Before torch starts OpenMP (benchmarks/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from layer_stats_cost import CLOCKS, QUIET, ROOT, Samples
from measure import synchronize
from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_train.config import WatchdogConfig, load_config
from trinity_train.health.watchdog import Watchdog
from trinity_train.records import Phase
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer

DEFAULT_CONFIG = ROOT / "configs" / "debug.toml"


def local_store() -> dist.Store:
    """A c10d TCPStore served by this process, as rank 0 of a job serves its peers'."""
    server = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    return dist.PrefixStore("trinity_train/heartbeat/0/", server)


def per_call_us(fn, calls: int) -> float:
    """Median microseconds of `fn()` over 5 batches of `calls` calls."""
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(batches)


def thread_wake_us(store, seconds: float = 3.0, repeats: int = 3) -> float:
    """Median CPU microseconds per wake-up of the watchdog's thread (publishing every tick), at the
    shortest tick (many wake-ups, so the difference stands out of the noise)."""

    class State:
        iteration = 1

    def cpu_of(watchdog: Watchdog | None) -> float:
        if watchdog is not None:
            watchdog.start(State(), store)
        begin, wall = time.process_time(), time.perf_counter()
        n = 0
        while time.perf_counter() - wall < seconds:
            time.sleep(0.01)
            if watchdog is not None:
                watchdog.enter(Phase.STEP, n)
            n += 1
        used = time.process_time() - begin
        if watchdog is not None:
            watchdog.stop()
            watchdog._thread.join()
        return used

    with tempfile.TemporaryDirectory() as run_dir:
        watchdog = Watchdog(WatchdogConfig(floor_s=1.0), RunDir(run_dir), rank=0)
        extra = [cpu_of(watchdog) - cpu_of(None) for _ in range(repeats)]
    return statistics.median(extra) / (seconds / watchdog.tick_s) * 1e6


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--pairs", type=int, default=15, help="iterations with the watchdog on")
    args, overrides = parser.parse_known_args(argv)
    print(f"# load: {loadavg()}")
    store = local_store()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(args.config, list(overrides) + QUIET + ["--metrics.layer_stats_every=0",
                                                                  f"--run.dir={run_dir}"])
        trainer = Trainer(cfg)
        trainer.start()
        callback = trainer.watchdog
        watchdog = callback.watchdog
        if watchdog is None:
            raise SystemExit("watchdog.enabled is false: nothing to measure")
        watchdog._stop.set()  # from here on the benchmark turns it on and off
        watchdog._thread.join()
        clocks = CLOCKS if trainer.device.type == "cpu" else {"wall": CLOCKS["wall"]}

        def iteration(on: bool) -> dict[str, float]:
            callback.watchdog = watchdog if on else None
            if on:
                watchdog.start(trainer.state, store)
            synchronize(trainer.device)
            start = {name: clock() for name, clock in clocks.items()}
            trainer.train_one_iteration()
            synchronize(trainer.device)
            took = {name: clock() - start[name] for name, clock in clocks.items()}
            if on:
                watchdog.stop()
                watchdog._thread.join()
            return took

        for on in (True, False, True, False):  # warm-up
            iteration(on)
        runs = [iteration(k % 2 == 1) for k in range(2 * args.pairs + 1)]  # off, on, ..., off
        result = {}
        for name in clocks:
            times = [r[name] for r in runs]
            samples = Samples(stats=times[1::2], plain=times[0::2],
                              extra=[times[i] - (times[i - 1] + times[i + 1]) / 2 for i in range(1, 2 * args.pairs, 2)])
            result[name] = samples
        step_s = statistics.median(result["wall"].plain)
        trainer.finish()

    probe = Watchdog(cfg.watchdog, RunDir(run_dir), rank=0)
    enter_us = per_call_us(lambda: probe.enter(Phase.STEP, 1), 20_000)
    beat = iter(range(1, 10**9))
    publish_us = per_call_us(lambda: store.set("0", f"[{next(beat)}, \"step\", 1]"), 500)
    print(f"config: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config} "
          f"{' '.join(overrides)}")
    print(f"watchdog tick {watchdog.tick_s:.2f} s (watchdog.floor_s={cfg.watchdog.floor_s:g})")
    entries = 2  # data and step; validation and saves add one more on their iterations
    publishes = max(1.0, step_s / watchdog.tick_s)
    wake_us = thread_wake_us(store)
    print(f"# load after: {loadavg()}")
    names = {"wall": "wall clock (paired iterations)", "cpu": "CPU time (paired iterations)"}
    rows = [[names[clock], *result[clock].cells(1), "per iteration with the watchdog on"] for clock in result]
    rows.append(["loop thread, timed directly", f"{100 * entries * enter_us * 1e-6 / step_s:.5f}", "-",
                 f"{entries * enter_us * 1e-3:.5f}", f"{step_s * 1e3:.0f}", "-",
                 f"{enter_us:.2f} us per phase entry x {entries} per iteration"])
    rows.append(["heartbeat, timed directly", f"{100 * publishes * publish_us * 1e-6 / step_s:.4f}", "-",
                 f"{publishes * publish_us * 1e-3:.4f}", f"{step_s * 1e3:.0f}", "-",
                 f"{publish_us:.1f} us per TCPStore.set (watchdog thread), at most one per tick: "
                 f"{publishes:.0f} per step"])
    rows.append(["thread wake-ups, timed directly", "-", "-", "-", "-", "-",
                 f"{wake_us:.0f} us of CPU per wake-up (publishing), one per {watchdog.tick_s:.2f} s tick = "
                 f"{100 * wake_us * 1e-6 / watchdog.tick_s:.3f} % of one core, whatever the step"])
    print(markdown_table(["measured by", "% of the step (median)", "quartiles, %", "ms added per iteration",
                          "step ms", "samples", "detail"], rows))

if __name__ == "__main__":
    main(sys.argv[1:])
