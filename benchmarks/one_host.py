"""One host must not get slower: tokens/s of one process and of `launch/local.sh 2` on the
multi-node benchmark's job, this checkout against an earlier revision, side by side in one run.

    python benchmarks/one_host.py [--before REV] [--rounds N] [--steps N] [--json FILE]

The communication work (DESIGN §4, §5 and §8: the gloo reduce-scatter, Muon's packed exchange,
prefetch, overlap, the exposed-communication clock) changes what every rank does in every step,
also when no link is slow. This says what it costs or saves where there is no network: REV
(default ef36355, the last commit before that work began) is checked out in a temporary git
worktree and run with this checkout's Python environment (`PYTHONPATH` names the tree); after one
job that is not counted, each round runs both jobs of both trees, the trees alternating. A job's
figure is the median tokens/s over its steps after the warm-up (as `benchmarks/multinode.py`
counts them). Printed: every job as it ends, then the medians over the rounds and their ratio
(this checkout / REV). The worktree is removed at the end, also after a failure, Ctrl-C or
SIGTERM (a running job is stopped first); the jobs' logs are kept only when something failed.

- one process: `python -m trinity_train.cli train` with multinode's job less its EP (one rank has
  no experts to split: `--parallel.ep=1`), the micro-batches accumulated on the one rank;
- `launch/local.sh 2`: multinode's job exactly (FSDP x EP over 2 gloo ranks on this host), the
  tree's own launcher.

Every process runs one OpenMP thread, with passive waits unless OMP_WAIT_POLICY says otherwise
(as multinode's ranks), so the two ranks of the 2-rank job do not fight over the machine's cores
with worker threads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trinity_harness.jobs import (COMMON, JOB_TIMEOUT_S, WARMUP_ITERS, job_environment, loadavg,
                       median_tokens_per_s, stop_session, tail, train_records)

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "ef36355"  # the last commit before the communication work (issue 30) began
ONE_PROCESS = tuple("--parallel.ep=1" if arg.startswith("--parallel.ep=") else arg for arg in COMMON)
JOBS = {  # name -> the command before the job's arguments
    "one process": (sys.executable, "-m", "trinity_train.cli", "train", *ONE_PROCESS),
    "launch/local.sh 2": ("launch/local.sh", "2", *COMMON),
}


class Failed(Exception):
    """A job or the worktree failed: one line for the user."""


def job_env(tree: Path) -> dict:
    """multinode's job environment, `tree`'s code."""
    return {**job_environment(), "PYTHONPATH": str(tree)}


def run_job(tree: Path, label: str, job: str, run_dir: Path, steps: int) -> dict:
    """One job of `tree` (called `label`), to the end; its tokens/s, steps and load."""
    load_start = loadavg()
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        # Its own session, so that `stop_session` reaches the launcher and torchrun and not this script.
        proc = subprocess.Popen([*JOBS[job], f"--run.dir={run_dir}", f"--train.steps={steps}"], cwd=tree,
                                env=job_env(tree), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failed(f"{job} of {label}: not finished within {JOB_TIMEOUT_S} s (its log: {log}):\n"
                         f"{tail([log])}") from None
        finally:
            stop_session(proc)
    if returncode != 0:
        raise Failed(f"{job} of {label} exited {returncode} (its log: {log}):\n{tail([log])}")
    records = train_records(run_dir)
    return {"tokens_per_s": median_tokens_per_s(records), "steps": len(records),
            "load_start": load_start, "load_end": loadavg()}


def add_worktree(rev: str, where: Path) -> None:
    done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
                          capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise Failed(f"--before {rev}: git could not check it out ({why}); "
                     "give a commit of this repository")


def remove_worktree(where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], capture_output=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)  # if the remove could not


def interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def compare(trees: dict[str, Path], rounds: int, steps: int, work: Path) -> list[dict]:
    """`rounds` rounds of every job of every tree, each printed as it ends, after one job that is
    not counted (the first job of a run was the slowest of its kind in the first runs: 1,356-1,358
    tokens/s where the same tree's later one-process jobs made 1,618-1,744)."""
    rows = []
    label, tree = next(iter(trees.items()))
    warmup = run_job(tree, label, "one process", work / "00-warm-up", steps)
    print(f"warm-up (not counted): {label} one process {warmup['tokens_per_s']:,.0f} tokens/s", flush=True)
    for rnd in range(1, rounds + 1):
        order = list(trees.items()) if rnd % 2 else list(trees.items())[::-1]  # alternate who goes first
        for tree_name, tree in order:
            for job in JOBS:
                run_dir = work / f"{len(rows) + 1:02d}-{tree_name.split()[0]}-{job.split()[0].replace('/', '-')}"
                row = {"round": rnd, "tree": tree_name, "job": job, **run_job(tree, tree_name, job, run_dir, steps)}
                rows.append(row)
                print(f"round {rnd} {tree_name:<14} {job:<18} {row['tokens_per_s']:>7,.0f} tokens/s  load "
                      f"{row['load_start']} -> {row['load_end']}", flush=True)
    return rows


def report(rows: list[dict], names: list[str]) -> list[str]:
    """The medians over the rounds, by job and tree, and their ratio (the second tree / the first)."""
    lines = [f"| job | {names[0]} tokens/s (median; rounds) | {names[1]} tokens/s (median; rounds) | "
             f"ratio {names[1]} / {names[0]} |", "|---|---|---|---|"]
    for job in JOBS:
        cells, medians = [], []
        for name in names:
            mine = [r["tokens_per_s"] for r in rows if r["job"] == job and r["tree"] == name]
            medians.append(statistics.median(mine))
            cells.append(f"{medians[-1]:,.0f}; {', '.join(format(x, ',.0f') for x in mine)}")
        lines.append(f"| {job} | {cells[0]} | {cells[1]} | {medians[1] / medians[0]:.2f} |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help=f"the revision to compare with (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four jobs")
    parser.add_argument("--steps", type=int, default=16, help="steps per job (the first 3 are warm-up)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps <= WARMUP_ITERS + 2:
        parser.error(f"--rounds must be >= 1 and --steps above {WARMUP_ITERS + 2} (the first {WARMUP_ITERS} are warm-up)")
    print(f"# load: {loadavg()}", flush=True)
    print(f"# the job: {' '.join(COMMON)} (multinode's; one process: --parallel.ep=1); OMP_NUM_THREADS=1", flush=True)
    names = [f"before {args.before}", "this checkout"]
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the job stopped, the worktree removed
        signal.signal(sig, interrupted)
    work = Path(tempfile.mkdtemp(prefix="one_host_runs_"))  # the jobs' run directories and logs
    error, code = None, 0
    with tempfile.TemporaryDirectory(prefix="one_host_") as tmp:
        before = Path(tmp) / "before"
        try:
            add_worktree(args.before, before)
            rows = compare({names[0]: before, names[1]: ROOT}, args.rounds, args.steps, work)
        except Failed as e:
            error, code = str(e), 1
        except KeyboardInterrupt as e:
            error, code = f"interrupted ({e or 'SIGINT'})", 130
        finally:
            remove_worktree(before)
    if error is not None:
        print(f"benchmarks/one_host.py: {error}", file=sys.stderr)
        if any(work.iterdir()):
            print(f"benchmarks/one_host.py: the jobs' run directories and logs are kept in {work}", file=sys.stderr)
        else:
            work.rmdir()
        return code
    shutil.rmtree(work, ignore_errors=True)
    print()
    for line in report(rows, names):
        print(line)
    print(f"# load after: {loadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": args.before, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
