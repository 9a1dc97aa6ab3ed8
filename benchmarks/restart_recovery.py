"""How often a torchrun job on 2 gloo ranks recovers when a worker is killed (SIGKILL).

    python benchmarks/restart_recovery.py [--trials 10] [--timeout-s 180] [--variants ...] [--trainer]

Each trial starts a 2-process job under torchrun with `--max-restarts=2`; in its first attempt
one worker is killed. A trial *recovers* when the job exits 0 within `--timeout-s`; otherwise it
failed (non-zero exit) or hung (killed at the deadline). Variants:

- `c10d`: `torchrun --standalone` (the c10d rendezvous with its shared TCPStore; torch's default)
- `c10d-fresh-store`: the same with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (what launch/ does)
- `static`: `--rdzv-backend=static` on a fixed master port

Without `--trainer` the job is benchmarks/restart_repro.py (pure torch); with it, the job is
`launch/local.sh 2` training a tiny model with checkpoints, the killed worker is rank 1 once the
first checkpoint exists, and a recovered trial must also have resumed from it and finished.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_train.config import load_config, save_config
from trinity_train.records import EventName

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
VARIANTS = ("c10d", "c10d-fresh-store", "static")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(variant: str) -> tuple[list[str], dict[str, str]]:
    env = {}
    if variant == "static":
        args = ["--nnodes=1", "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                "--node-rank=0"]
    else:
        args = ["--standalone", "--nnodes=1"]
    if variant == "c10d-fresh-store":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return args, env


def repro_trial(variant: str, timeout_s: float, init_timeout_s: float) -> tuple[str, float, str]:
    args, env = torchrun_args(variant)
    cmd = [TORCHRUN, *args, "--nproc-per-node=2", "--max-restarts=2",
           str(ROOT / "benchmarks" / "restart_repro.py"), str(init_timeout_s)]
    return run_job(cmd, {**os.environ, **env}, timeout_s, on_start=None)


def run_job(cmd, env, timeout_s, on_start) -> tuple[str, float, str]:
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        if on_start is not None:
            on_start(proc, started + timeout_s)
        try:
            code = proc.wait(timeout=max(1.0, started + timeout_s - time.monotonic()))
            outcome = "recovered" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome = "hung"
        log.seek(0)
        text = log.read()
    reason = next((line.strip()[:160] for line in reversed(text.splitlines())
                   if "connectFullMesh" in line or "Error" in line), "")
    return outcome, time.monotonic() - started, reason


# A 2-layer MoE that trains 30 steps in seconds, checkpointing every 5.
TRAINER_SETTINGS = {
    "model": dict(vocab_size=320, hidden_size=32, num_layers=2, num_dense_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, sliding_window=8, global_every=2),
    "data": {"seq_len": 16}, "train": {"steps": 30, "micro_batch_size": 2}, "eval": {"every": 0},
    "checkpoint": {"every": 5}, "metrics": {"progress_bar": False, "peak_flops": 1e11},
}


def worker_pids(launcher_pid: int) -> list[int]:
    """The python training processes below a launcher (torchrun's children)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        pid, ppid, args = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = [], [launcher_pid]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            todo.append(pid)
            if "trinity_train.cli train" in args and "torchrun" not in args:
                found.append(pid)
    return sorted(found)


def trainer_trial(variant: str, timeout_s: float, data: Path, root: Path) -> tuple[str, float, str]:
    run_dir = root / f"run-{random.getrandbits(32):08x}"
    config = root / "tiny.toml"
    save_config(load_config(None, TRAINER_SETTINGS), config)
    # the launcher's python and torchrun are this interpreter's
    env = {**os.environ, "MAX_RESTARTS": "2", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if variant == "c10d":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"  # undo what launch/local.sh sets
    cmd = ["launch/local.sh", "2", "--config", str(config), f"--data.path={data}", f"--run.dir={run_dir}"]

    def kill_a_worker_after_the_first_checkpoint(proc, deadline):
        while time.monotonic() < deadline and proc.poll() is None:
            if any((run_dir / "checkpoints").glob("step_*[0-9]")):
                pids = worker_pids(proc.pid)
                if len(pids) == 2:
                    os.kill(pids[1], signal.SIGKILL)
                    return
            time.sleep(0.2)

    if variant == "static":
        raise SystemExit("--trainer measures the launchers' own rendezvous (c10d, with or without a shared store)")
    outcome, seconds, reason = run_job(cmd, env, timeout_s, kill_a_worker_after_the_first_checkpoint)
    if outcome == "recovered":
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
        resumed = [e for e in events if e.get("event") == EventName.RESUME]
        ends = [e for e in events if e.get("event") == EventName.RUN_END]
        if not resumed or not ends or ends[-1]["step"] != 30:
            outcome = "finished without resuming"
    return outcome, seconds, reason


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--init-timeout-s", type=float, default=60.0, help="the repro's process-group timeout")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--trainer", action="store_true", help="kill a worker of a real training job")
    parser.add_argument("--data", help="--trainer: a prepared dataset (default: a small one made here)")
    args = parser.parse_args(argv)
    print(f"# load: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = Path(args.data) if args.data else None
        if args.trainer and data is None:
            from trinity_harness.corpus import prepare_word_corpus

            words = "the quick brown fox jumps over a lazy dog while one small cat sat".split()
            (root / "corpus").mkdir()
            data = prepare_word_corpus(root / "corpus", words, seed=0, num_docs=40)
        summary = {}
        for variant in args.variants:
            outcomes = []
            for trial in range(args.trials):
                if args.trainer:
                    outcome, seconds, reason = trainer_trial(variant, args.timeout_s, data, root)
                else:
                    outcome, seconds, reason = repro_trial(variant, args.timeout_s, args.init_timeout_s)
                outcomes.append(outcome)
                print(f"{variant} trial {trial + 1}: {outcome} in {seconds:.0f}s {reason}", flush=True)
            summary[variant] = outcomes.count("recovered")
        print(markdown_table(["variant", "recovered"],
                             [[variant, f"{recovered} / {args.trials}"] for variant, recovered in summary.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
