"""Two-rank runs of the rank statistics (gloo ranks of a `ranks.RankPool`): a clean run, and a
`slow_rank` drill run (`write_slow_rank_run`) whose run directory the rank-health tests and the
dashboard's browser test read: what they check must be what a real two-rank run writes.

The slow-rank run: `SLOW_STEPS` steps of 2 x 16 tokens (one row per rank), rank statistics every
`EVERY` iterations, rank 1 given `SLOW_SECONDS` of extra work in iterations `SLOW_FIRST` ..
`SLOW_LAST`, so reports `SLOW_FIRST + EVERY - 1` on find it slow and the last report finds it
recovered.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conftest import run_config
from trinity_harness.ranks import rank_trainer
from trinity_train.config import Config
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir

EVERY = 5
SLOW_RANK, SLOW_FIRST, SLOW_LAST, SLOW_SECONDS = 1, 6, 25, 0.1
SLOW_STEPS = 35
REPORTS = 3  # metrics.straggler_reports: the default


def two_rank_config(corpus: Path, run_dir: Path, steps: int, *faults: dict, **metrics) -> Config:
    """`steps` steps of one 16-token row per rank, nothing else due (no validation, checkpoints
    or layer statistics) and no spike guard (a tiny model fitting word salad for 300 steps has
    loss spikes): the rank statistics and `faults` alone."""
    return run_config(corpus, run_dir, model={"num_layers": 2, "global_every": 2}, optim={"name": "adamw"},
                      train={"steps": steps, "micro_batch_size": 1, "grad_accum": 1}, eval={"every": 0},
                      checkpoint={"every": 0}, metrics={"layer_stats_every": 0, **metrics},
                      stability={"spike_zscore": 0.0, "rollback_after": 0, "inject": [dict(f) for f in faults]})


def train_two_ranks(corpus: Path, run_dir: Path, steps: int, faults: list[dict], metrics: dict) -> int:
    """A `RankPool` job: train `two_rank_config` on this rank."""
    rank_trainer(two_rank_config(corpus, run_dir, steps, *faults, **metrics)).run()
    return 0


SLOW_DRILL = {"fault": "slow_rank", "first": SLOW_FIRST, "last": SLOW_LAST, "rank": SLOW_RANK, "seconds": SLOW_SECONDS}


@dataclass
class SlowRankRun:
    path: Path
    reports: list[dict]  # the ranks records
    stragglers: list[dict]  # the straggler events
    hosts: list[str]


def write_slow_rank_run(corpus: Path, run_dir: Path, rank_pool) -> SlowRankRun:
    rank_pool(2).run(train_two_ranks, corpus, run_dir, SLOW_STEPS, [SLOW_DRILL], {"rank_stats_every": EVERY})
    rd = RunDir(run_dir)
    (hosts,) = rd.read_events(EventName.RANK_HOSTS)
    return SlowRankRun(rd.path, rd.read_metrics(RecordKind.RANKS), rd.read_events(EventName.STRAGGLER), hosts["hosts"])
