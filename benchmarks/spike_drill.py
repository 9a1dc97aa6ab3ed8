"""The spike guard against every fault drill, on the default model and data.

A clean run of the default job's model trains `--steps` steps (default 1,000) with the guard on
and checkpoints; its false positives (skipped steps, rollbacks, routing-collapse incidents) must be
0. Each drill then starts from the clean run's checkpoint at `--drill-from` (resume is exact, so
the drill and clean runs share everything before it), injects its fault a few steps later, and
trains to the end; one more run trains from step 0 with both learning rates x100 (the warm-up
drill: the guard must judge before it has any history). One table: per scenario, detected, steps
skipped, rollbacks, routing-collapse incidents, batches ruled out, final validation loss against
the clean run's (for the runs that reached its last step). Then the guard's cost per step (the
detector on the real run's signals, timed) as a fraction of the clean run's median step time.

    python benchmarks/spike_drill.py [--steps 1000] [--drill-from 800] [--out DIR] [--a.b=value ...]

About 1,800 optimizer steps in all: 43 minutes on this 2-core machine with the test suite sharing it
(benchmarks/README.md section 11).
"""

from __future__ import annotations

import os

# Before torch starts OpenMP (see trinity_train/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_train.checkpoint.layout import step_dir_name
from trinity_train.config import Config, FaultConfig, load_config, validate
from trinity_train.run_config import validate_rules
from trinity_train.data import SkipLedger
from trinity_train.rundir import RunDir
from trinity_train.stability import StepGuard, TrainingDivergedError
from trinity_train.train import train
from trinity_train.records import EventName, RecordKind

ROOT = Path(__file__).resolve().parent.parent


def scenarios(start: int) -> dict[str, list[dict]]:
    """Drill name -> faults, placed a few steps after the drills' starting checkpoint (iteration
    i draws batch i - 1 there: the clean run skipped nothing)."""
    at = start + 12
    return {
        "NaN loss": [{"fault": "nan_loss", "first": at}],
        "gradient x1000": [{"fault": "grad_scale", "first": at}],
        "loss x10": [{"fault": "loss_spike", "first": at}],
        "poisoned range (random tokens)": [{"fault": "poison_random", "first": at, "last": at + 15}],
        "poisoned range (one token)": [{"fault": "poison_repeat", "first": at, "last": at + 15, "token": 42}],
        "learning rate x20 to the end": [{"fault": "lr_scale", "first": at, "last": 10**9}],
    }


# The run that trains from step 0 with both learning rates this many times the job's (issue 18's
# point 4: the loss rises above the untrained model's inside the warm-up).
WARMUP_LR_FACTOR, WARMUP_STEPS = 100, 120


def config(run_dir: Path, steps: int, every: int, overrides: list[str], faults: list[dict] = (),
           resume: bool = False, lr_factor: float = 1.0) -> Config:
    """The default job for `steps` steps, checkpointing every `every` and keeping them all."""
    cfg = load_config(ROOT / "configs" / "debug.toml", overrides)
    cfg.optim.lr, cfg.optim.muon_lr = cfg.optim.lr * lr_factor, cfg.optim.muon_lr * lr_factor
    cfg.train.steps, cfg.eval.every, cfg.train.log_every = steps, steps, 100
    cfg.checkpoint.every, cfg.checkpoint.keep = every, steps
    cfg.checkpoint.resume = "auto" if resume else "none"
    cfg.metrics.progress_bar = False
    cfg.run.dir = str(run_dir)
    cfg.stability.inject = [FaultConfig(**f) for f in faults]
    validate(cfg)
    validate_rules(cfg)
    return cfg


def outcome(run_dir: Path, halted: bool) -> dict:
    run = RunDir(run_dir)
    records = run.read_metrics(RecordKind.TRAIN)
    vals = run.read_metrics(RecordKind.VAL)
    rollbacks = run.read_events(EventName.ROLLBACK)
    routing = run.read_events(EventName.ROUTING_COLLAPSE)
    ruled_out = sum(r.end - r.start for r in SkipLedger.load(run.ledger).ranges)
    return {"skipped": sum(r["skipped"] for r in records), "rollbacks": len(rollbacks),
            "ruled_out": ruled_out, "val_loss": vals[-1]["val_loss"] if vals else None, "halted": halted,
            "routing": len(routing), "steps": records[-1]["step"] if records else 0,
            "step_times": [r["step_time_s"] for r in records if not r["skipped"]],
            "signals": [(r["loss"], r["grad_norm"], r["step"]) for r in records]}


def run_drill(clean_dir: Path, run_dir: Path, start: int, steps: int, every: int, faults: list[dict],
              overrides: list[str]) -> dict:
    """Train from the clean run's checkpoint at `start` with `faults` injected."""
    shutil.copytree(RunDir(clean_dir).checkpoints / step_dir_name(start), RunDir(run_dir).checkpoints / step_dir_name(start))
    return train_to_outcome(config(run_dir, steps, every, overrides, faults, resume=True))


def train_to_outcome(cfg: Config) -> dict:
    try:
        train(cfg)
        return outcome(Path(cfg.run.dir), halted=False)
    except TrainingDivergedError:
        return outcome(Path(cfg.run.dir), halted=True)


def guard_cost(cfg: Config, signals: list[tuple[float, float, int]]) -> float:
    """Seconds per call of the guard's verdict on the clean run's own signals."""
    guard = StepGuard.for_config(cfg)
    started = time.perf_counter()
    for i, (loss, grad_norm, step) in enumerate(signals, start=1):
        guard.judge(loss, grad_norm, i, step - 1)
    return (time.perf_counter() - started) / len(signals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--drill-from", type=int, default=800, help="the drills' starting checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--out", type=Path, help="keep the run directories here (default: a temporary directory)")
    args, overrides = parser.parse_known_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="spike_drill_"))
    print(f"load before: {loadavg()}", flush=True)

    started = time.perf_counter()
    clean_dir = root / "clean"
    if args.drill_from % args.checkpoint_every:
        parser.error("--drill-from must be a multiple of --checkpoint-every")
    cfg = config(clean_dir, args.steps, args.checkpoint_every, overrides)
    train(cfg)
    clean = outcome(clean_dir, halted=False)
    print(f"clean: {args.steps} steps in {time.perf_counter() - started:.0f} s", flush=True)

    rows = []
    for name, faults in scenarios(args.drill_from).items():
        rows.append((name, run_drill(clean_dir, root / f"drill{len(rows)}", args.drill_from, args.steps,
                                     args.checkpoint_every, faults, overrides)))
        print(f"{name}: done", flush=True)
    warmup_steps = min(WARMUP_STEPS, args.steps)
    warmup_name = f"lr x{WARMUP_LR_FACTOR} from step 0 ({warmup_steps})"
    rows.append((warmup_name, train_to_outcome(config(root / "warmup_lr", warmup_steps, args.checkpoint_every,
                                                      overrides, lr_factor=WARMUP_LR_FACTOR))))
    print(f"{warmup_name}: done", flush=True)

    table = [["clean (false positives)", "-", clean["skipped"], clean["rollbacks"], clean["routing"],
              clean["ruled_out"], f"{clean['val_loss']:.4f}", ""]]
    for name, r in rows:
        detected = "yes" if r["skipped"] or r["rollbacks"] or r["routing"] else "no"
        val = "halted" if r["halted"] else f"{r['val_loss']:.4f}"
        # Only a run that trained the clean run's steps compares with it.
        ratio = f"{(r['val_loss'] / clean['val_loss'] - 1) * 100:+.2f}%" if r["steps"] == args.steps else ""
        table.append([name, detected, r["skipped"], r["rollbacks"], r["routing"], r["ruled_out"], val, ratio])
    print(f"\nfalse positives in the clean run: {clean['skipped']} skipped steps, {clean['rollbacks']} rollbacks, "
          f"{clean['routing']} routing-collapse incidents")

    per_call = guard_cost(cfg, clean["signals"])
    step = statistics.median(clean["step_times"])
    print(f"guard verdict: {per_call * 1e6:.0f} us per step = {per_call / step * 100:.3f} % of the median "
          f"step ({step:.3f} s)")
    print(f"load after: {loadavg()}; wall {time.perf_counter() - started:.0f} s")
    print(f"\nthe default model, {args.steps} steps; drills from the clean run's step {args.drill_from}\n")
    print(markdown_table(["scenario", "detected", "skipped", "rollbacks", "routing", "batches out", "final val loss",
                          "vs clean"], table))
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
