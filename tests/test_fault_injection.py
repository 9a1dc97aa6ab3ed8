"""Fault injection with real processes: the trainer is killed (SIGKILL) at each moment of a
synchronous and an asynchronous save, and resumed with --checkpoint.resume=auto in a new process;
its losses (metrics.jsonl) and final weights must equal an uninterrupted run's bit for bit. And a
flipped byte in the newest checkpoint: `ckpt verify` fails, and the resume falls back to the
checkpoint before it, again bit-identical."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ONE_THREAD_ENV, run_config, run_python
from trinity_train.checkpoint import load_model_checkpoint
from trinity_train.config import save_config
from trinity_train.rundir import RunDir
from trinity_train.records import EventName, RecordKind

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def trinity(*args, killed_at: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    """The console script (or kill_at.py's, which dies at a moment of a save), with one thread: the
    same math in every process."""
    prefix = [HERE / "kill_at.py", *killed_at] if killed_at else ["-m", "trinity_train.cli"]
    return run_python(*prefix, *args, env=ONE_THREAD_ENV)


@pytest.fixture(scope="module")
def config(corpus, tmp_path_factory) -> Path:
    """8 steps, a checkpoint every 2, the lr changing every step."""
    path = tmp_path_factory.mktemp("fault") / "config.toml"
    save_config(run_config(corpus, path.parent / "unused",
                           train={"steps": 8, "micro_batch_size": 2, "grad_accum": 2}, eval={"every": 0},
                           optim={"warmup_steps": 2, "decay_fraction": 0.5},
                           checkpoint={"every": 2, "keep": 2}), path)
    return path


def train(config, run_dir, *extra, killed_at=None) -> subprocess.CompletedProcess:
    return trinity("train", "--config", config, f"--run.dir={run_dir}", *extra, killed_at=killed_at)


def losses(run_dir) -> list[tuple]:
    return [(r["iter"], r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in RunDir(run_dir).read_metrics(RecordKind.TRAIN)]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    model, _ = load_model_checkpoint(RunDir(run_dir).checkpoints / "step_00000008")
    return model.state_dict()


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = train(config, run_dir)
    assert done.returncode == 0, done.stderr
    return losses(run_dir), final_weights(run_dir)


def assert_same_as(reference, run_dir):
    expected_losses, expected_weights = reference
    assert losses(run_dir) == expected_losses
    for name, tensor in final_weights(run_dir).items():
        assert torch.equal(tensor, expected_weights[name]), name


@pytest.mark.parametrize("async_save, moment, resumes_from", [
    (False, "write", 2), (False, "checksums", 2), (False, "rename", 2), (False, "retention", 4),
    (True, "write", 2), (True, "checksums", 2), (True, "retention", 4),
])
def test_killed_during_a_save_resumes_bit_identically(config, reference, tmp_path, async_save, moment, resumes_from):
    run_dir = tmp_path / "run"
    mode = f"--checkpoint.async_save={str(async_save).lower()}"
    killed = train(config, run_dir, mode, killed_at=(moment, 4))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    resumed = train(config, run_dir, mode, "--checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert RunDir(run_dir).read_events(EventName.RESUME)[-1]["checkpoint"].endswith(f"step_{resumes_from:08d}")
    assert not list(RunDir(run_dir).checkpoints.glob("*.tmp"))  # the interrupted save was cleared away
    assert_same_as(reference, run_dir)


def test_a_flipped_byte_fails_verification_and_the_resume_falls_back(config, reference, tmp_path):
    run_dir = tmp_path / "run"
    killed = train(config, run_dir, killed_at=("retention", 6))  # checkpoints 4 and 6 complete
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    newest = RunDir(run_dir).checkpoints / "step_00000006"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    verify = trinity("ckpt", "verify", newest)
    assert verify.returncode == 1 and verify.stderr.startswith("error: ") and "does not match its" in verify.stderr
    assert trinity("ckpt", "verify", RunDir(run_dir).checkpoints / "step_00000004").returncode == 0

    resumed = train(config, run_dir, "--checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    passed = RunDir(run_dir).read_events(EventName.CHECKPOINT_PASSED_OVER)
    assert [e["path"] for e in passed] == [str(newest)] and "does not match" in passed[0]["reason"]
    assert RunDir(run_dir).read_events(EventName.RESUME)[-1]["checkpoint"].endswith("step_00000004")
    assert_same_as(reference, run_dir)
