"""Restarts recover: a collective whose peer never arrives fails after `parallel.collective_timeout_s`
(not torch's 30 minutes), a job torchrun restarted resumes from its newest sound checkpoint
whatever `checkpoint.resume` says, and the launchers restart a job whose worker was killed."""

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
from ranks import free_port
from trinity_train.config import load_config
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


def test_a_collective_whose_peer_never_arrives_fails_after_the_configured_timeout(tmp_path):
    out = tmp_path / "rank0.json"
    ctx = mp.start_processes(absent_peer, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    ctx.join(timeout=400)
    for proc in ctx.processes:
        proc.kill()
    result = json.loads(out.read_text())
    assert result["outcome"].startswith("failed") and "imed out" in result["outcome"]  # gloo: "Timed out"


def config(corpus, run_dir, **checkpoint):
    return run_config(corpus, run_dir, train={"steps": 4, "micro_batch_size": 2, "eval_every": 0},
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
def test_the_local_launcher_restarts_a_job_whose_worker_was_killed():
    # benchmarks/restart_recovery.py --trainer: launch/local.sh 2, SIGKILL of rank 1 after the first
    # checkpoint; recovered means torchrun restarted both, they resumed, and the run finished.
    done = run_python("benchmarks/restart_recovery.py", "--trainer", "--trials", "1", "--variants",
                      "c10d-fresh-store", "--timeout-s", "400", env=ONE_THREAD_ENV, ok=True)
    assert "| c10d-fresh-store | 1 / 1 |" in done.stdout, done.stdout
