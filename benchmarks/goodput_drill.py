"""Where a drilled run's time goes: a two-rank job under launch/local.sh (torchrun, restarts) on the
default corpus with a small model, rehearsing a killed rank, a hung rank and a rollback in one
run, then its `trinity-train goodput` table, with the check that the categories add up to the
wall time and agree with the events.

    python benchmarks/goodput_drill.py [--steps 40] [--out DIR]

The drills (stability.inject): rank 1 SIGKILLed at iteration 8 (torchrun restarts the job from
the checkpoint of step 5), rank 1 standing still at iteration 14 (both ranks' watchdogs fire
after max(floor 4 s, 3 x the longest step); torchrun restarts from step 10), NaN losses at
iterations 21-22 (skipped, then rolled back to a checkpoint from before them). Prints the
launcher's wall time beside the account's, the load, and last the goodput table in markdown.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_train.goodput.account import CATEGORIES
from trinity_train.goodput.table import LABELS
from trinity_train.records import EventName

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = ["--model.hidden_size=64", "--model.num_layers=2", "--model.head_dim=16",
               "--model.intermediate_size=128", "--model.moe_intermediate_size=32"]
DRILLS = ('[{fault="kill_rank", first=8, rank=1}, {fault="hang_rank", first=14, rank=1, seconds=600}, '
          '{fault="nan_loss", first=21, last=22}]')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", help="run directory to keep (default: a temporary one)")
    args = parser.parse_args()
    run_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="goodput-drill-")) / "run"
    command = ["launch/local.sh", "2", "--max-restarts=3", *SMALL_MODEL, f"--train.steps={args.steps}",
               "--eval.every=10", "--checkpoint.every=5", "--metrics.progress_bar=false",
               "--watchdog.floor_s=4", "--watchdog.multiple=3", "--stability.rollback_after=2",
               "--stability.rollback_lookback=2", f"--stability.inject={DRILLS}", f"--run.dir={run_dir}"]
    print(f"# load before: {loadavg()}", flush=True)
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    launcher_wall = time.time() - started
    print(f"# load after: {loadavg()}", flush=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    account = json.loads(subprocess.run([sys.executable, "-m", "trinity_train.cli", "goodput", str(run_dir), "--json"],
                                        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    names = [e["event"] for e in events]
    accounted = sum(account["seconds"].values())
    print(f"categories {accounted:.1f} s, wall {account['wall_s']:.1f} s ({100 * (accounted / account['wall_s'] - 1):+.2f} %); "
          f"the launcher ran {launcher_wall:.1f} s (its own start before the first worker and its exit are outside)")
    print(f"events: {names.count(EventName.RUN_START)} starts, {names.count(EventName.HANG)} hang events, "
          f"{names.count(EventName.ROLLBACK)} rollback(s), {names.count(EventName.SKIP)} skips")
    step_s = median_step_seconds(run_dir)
    write_s = timeline_write_seconds()
    print(f"writing an iteration's timeline line: {write_s * 1e6:.1f} us, {100 * write_s / step_s:.3f} % of the "
          f"drill's median step ({step_s * 1e3:.1f} ms), load {loadavg()}")
    steps = account["steps"]
    print(f"goodput {100 * account['goodput']:.1f}% (steps kept / wall); iterations: {steps['productive']} kept, "
          f"{steps['undone']} undone, {steps['skipped']} skipped; {len(account['attempts'])} attempt(s)")
    for a in account["attempts"]:
        print(f"  #{a['attempt']}: {a['host']} pid {a['pid']}, {a['devices']} device(s), from iteration "
              f"{a['start_iter']}, {a['status'] or 'killed or lost (no end record)'}")
    print(f"run directory: {run_dir}")
    print(goodput_table(account))
    return 0


def goodput_table(account: dict) -> str:
    """`trinity-train goodput`'s table (its --json account) as markdown: a category a row, seconds
    and share of the wall time, then each attempt's seconds."""
    attempts = account["attempts"]
    wall = account["wall_s"]
    rows = [[LABELS[name], f"{account['seconds'][name]:.1f}",
             f"{100 * account['seconds'][name] / wall:.1f}" if wall > 0 else "-",
             *(f"{a['seconds'][name]:.1f}" for a in attempts)] for name in CATEGORIES]
    rows.append(["wall", f"{wall:.1f}", "100.0", *(f"{a['wall_s']:.1f}" for a in attempts)])
    return markdown_table(["category", "total s", "% of wall", *(f"attempt #{a['attempt']} s" for a in attempts)], rows)


def median_step_seconds(run_dir: Path) -> float:
    lines = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted(r["end"] - r["start"] for r in lines if r.get("kind") == "iteration")
    return steps[len(steps) // 2]


def timeline_write_seconds(repeats: int = 2000) -> float:
    """What the main process pays per iteration for the timeline: building and appending one
    iteration line (the writer as the trainer runs it), best of three rounds."""
    from types import SimpleNamespace

    from trinity_train.observe.timeline import TimelineWriter

    with tempfile.TemporaryDirectory() as folder:
        writer = TimelineWriter(Path(folder) / "timeline.jsonl")
        trainer = SimpleNamespace(state=SimpleNamespace(iteration=0, step=0), dims=SimpleNamespace(world_size=1))
        writer.on_start(trainer)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for i in range(repeats):
                writer.iteration_begun()
                for phase in ("data", "step"):
                    writer.phase_end(trainer, phase, 0.001)
                writer.iteration_done(trainer, i, skipped=False, failed=False)
            best = min(best, (time.perf_counter() - started) / repeats)
        writer.close(trainer, "ended")
    return best


if __name__ == "__main__":
    sys.exit(main())
