"""Restarts recover: a collective whose peer never arrives fails after `parallel.collective_timeout_s`
(not torch's 30 minutes), a job torchrun restarted resumes from its newest sound checkpoint
whatever `checkpoint.resume` says, the launchers restart a job whose worker was killed or hung
(the `kill_rank` and `hang_rank` drills: once each, then the run finishes, a rollback too, and
where its time went adds up), and a launcher whose
torchrun gave up exits 75 when the last attempt failed restartably, so a scheduler requeues it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ONE_THREAD_ENV, ROOT, SUBPROCESS_ENV, run_config, run_python
from goodput_check import checked_account
from trinity_harness.ranks import free_port
from trinity_train import exit_codes
from trinity_train.config import load_config, save_config
from trinity_train.launcher_verdict import restartable_marker_name
from trinity_train.records import EventName
from trinity_train.rundir import RunDir
from trinity_train.parallel.process_group import init_distributed
from trinity_train.train import Trainer



def absent_peer(rank: int, port: int, out: str) -> None:
    """Rank 0 all-reduces over the mesh's data-parallel group; rank 1 never joins that collective
    and leaves only once rank 0 has given up, so rank 0 can only have stopped by timing out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    cfg = load_config(None, ["--parallel.init_timeout_s=600", "--parallel.collective_timeout_s=3"])
    dims, _ = init_distributed(cfg)
    result = Path(out)
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=dims.dp_mesh.get_group())
            outcome = "completed"
        except RuntimeError as e:
            outcome = f"failed: {e}"
        result.write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}))
    else:
        deadline = time.monotonic() + 300
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    os._exit(0)  # the group is broken: no clean teardown to wait for


@pytest.mark.slow  # waits out the configured collective timeout (~11 s)
def test_a_collective_whose_peer_never_arrives_fails_after_the_configured_timeout(tmp_path):
    out = tmp_path / "rank0.json"
    ctx = mp.start_processes(absent_peer, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    ctx.join(timeout=400)
    for proc in ctx.processes:
        proc.kill()
    result = json.loads(out.read_text())
    assert result["outcome"].startswith("failed") and "imed out" in result["outcome"]  # gloo: "Timed out"


def config(corpus, run_dir, **checkpoint):
    return run_config(corpus, run_dir, train={"steps": 4, "micro_batch_size": 2}, eval={"every": 0},
                      checkpoint={"every": 2, **checkpoint})


def test_a_restarted_job_resumes_from_its_newest_sound_checkpoint(corpus, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    Trainer(config(corpus, run_dir)).run()
    assert Trainer(config(corpus, run_dir)).resume_from is None  # a first start does what it says
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    newest = run_dir / "checkpoints" / "step_00000004"
    assert Trainer(config(corpus, run_dir)).resume_from == newest
    other = tmp_path / "elsewhere"
    Trainer(config(corpus, other)).run()
    # A run started from another run's checkpoint continues from its own once it has one.
    assert Trainer(config(corpus, run_dir, resume=str(other / "checkpoints" / "step_00000002"))).resume_from == newest
    fresh = tmp_path / "fresh"  # restarted before its first checkpoint: starts as configured
    assert Trainer(config(corpus, fresh, resume=str(other / "checkpoints" / "step_00000002"))).resume_from == \
        other / "checkpoints" / "step_00000002"


def test_the_launchers_check_their_restart_count(tmp_path):
    for launcher in (["launch/local.sh", "2"], ["launch/multinode.sh", "1", "0", "127.0.0.1", "1", "--"]):
        done = subprocess.run([*launcher, "--max-restarts=x"], cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and "--max-restarts must be a number >= 0, got 'x'" in done.stderr


@pytest.mark.slow
def test_the_local_launcher_restarts_a_job_whose_worker_was_killed(corpus):
    # benchmarks/restart_recovery.py --trainer: launch/local.sh 2, SIGKILL of rank 1 after the first
    # checkpoint; recovered means torchrun restarted both, they resumed, and the run finished.
    done = run_python("benchmarks/restart_recovery.py", "--trainer", "--trials", "1", "--variants",
                      "c10d-fresh-store", "--timeout-s", "400", "--data", corpus, env=ONE_THREAD_ENV, ok=True)
    assert "| c10d-fresh-store | 1 / 1 |" in done.stdout, done.stdout


# A torchrun that leaves what its workers would have left in the launcher's folder and fails, so
# the launcher's reading of it is tested without starting any.
FAKE_TORCHRUN = """#!/usr/bin/env bash
for name in $FAKE_FILES; do printf '%b' "$FAKE_TEXT" >"$TRINITY_LAUNCHER_VERDICT/$name"; done
exit 1
"""


@pytest.mark.parametrize("files, text, code, says", [
    ([restartable_marker_name(2, 1)], "watchdog: rank 1 hung", exit_codes.RESTARTABLE, "watchdog: rank 1 hung"),
    ([restartable_marker_name(0, 0)], "watchdog: rank 0 hung", exit_codes.FAILURE, None),  # an earlier attempt's
    ([], "", exit_codes.FAILURE, None),  # a crash: to inspect, not to requeue
    (["rank000000", restartable_marker_name(2, 1)], "2\\tconfig mistake", exit_codes.CONFIG, "error: config mistake"),
])
def test_the_launcher_exits_75_when_restarts_ran_out_on_a_restartable_failure(tmp_path, files, text, code, says):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text(FAKE_TORCHRUN)
    (fake / "torchrun").chmod(0o755)
    env = {**SUBPROCESS_ENV, "PATH": f"{fake}{os.pathsep}{SUBPROCESS_ENV['PATH']}", "FAKE_FILES": " ".join(files),
           "FAKE_TEXT": text + "\\n"}
    done = subprocess.run(["bash", "-c", 'source launch/restarts.sh "$@"; run_torchrun', "-", "--max-restarts=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    if says:
        assert done.stderr.strip().splitlines()[-1].count(says) == 1, done.stderr


@pytest.mark.slow
def test_a_killed_and_a_hung_rank_are_restarted_once_each_and_the_run_finishes(corpus, tmp_path):
    """Two ranks under launch/local.sh: rank 1 dies at iteration 3 (kill_rank: after the checkpoint
    of step 2) and, in the restart, stands still at iteration 6 (hang_rank); the watchdogs end both
    ranks (rank 0's names rank 1 as behind), torchrun restarts again, and the third attempt,
    meeting neither drill, finishes."""
    config = tmp_path / "drills.toml"
    save_config(run_config(corpus, tmp_path / "unused", train={"steps": 12, "micro_batch_size": 1}, eval={"every": 0},
                           checkpoint={"every": 2}, watchdog={"floor_s": 4.0, "multiple": 3.0},
                           stability={"rollback_after": 2, "rollback_lookback": 2,
                                      "inject": [{"fault": "kill_rank", "first": 3, "rank": 1},
                                                 {"fault": "hang_rank", "first": 6, "rank": 1, "seconds": 120},
                                                 {"fault": "nan_loss", "first": 9, "last": 10}]}),
                config)
    run = RunDir(tmp_path / "run")
    done = subprocess.run(["launch/local.sh", "2", "--max-restarts=2", "--config", str(config), f"--run.dir={run.path}"],
                          cwd=ROOT, env=ONE_THREAD_ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    drills = [(e["fault"], e["iter"], e["rank"]) for e in run.read_events(EventName.FAULT_INJECTED)]
    assert drills == [("kill_rank", 3, 1), ("hang_rank", 6, 1), ("nan_loss", 9, None), ("nan_loss", 10, None)]
    assert [e["checkpoint"].rsplit("/", 1)[-1] for e in run.read_events(EventName.RESUME)] == \
        ["step_00000002", "step_00000004"]
    hangs = run.read_events(EventName.HANG)
    assert {e["rank"] for e in hangs} <= {0, 1} and any(e["behind"] == [1] for e in hangs), hangs
    assert all(e["iter"] == 6 and e["exit_code"] == 75 and (run.path / e["stacks"]).is_file() for e in hangs)
    assert [e["phase"] for e in hangs if e["rank"] == 1] in ([], ["data"])
    assert run.read_events(EventName.RUN_END)[-1]["step"] == 12
    assert done.stderr.count("watchdog: rank ") == len(hangs) >= 1
    # Iterations 9 and 10 are skipped (NaN loss) and rolled back; then where the time went: three
    # attempts, the time between them lost, the iterations after each resume's checkpoint undone.
    (rollback,) = run.read_events(EventName.ROLLBACK)
    assert rollback["iter"] == 10 and rollback["to_step"] <= 6
    result = checked_account(run.path)
    assert len(result.attempts) == 3 and [a.status for a in result.attempts][-1] == "ended"
    assert all(a.lost_before > 0 for a in result.attempts[1:])
    assert result.seconds["rollback"] > 0 and result.steps["undone"] > 0
