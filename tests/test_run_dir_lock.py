"""A run owns its directory: a second start on the directory of a live run is refused in one line
naming the holder, before it touches anything, whether both start together or the second while
the first trains; the first run's records and checkpoints are whole. A killed run's lock goes
with its process, so it never blocks the resume."""

from __future__ import annotations

import socket
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from conftest import ONE_THREAD_ENV, assert_one_line_error, run_config, run_python
from trinity_train.checkpoint.integrity import check_integrity
from trinity_train.config import save_config
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir
from trinity_train.runlock import RunDirInUseError, RunDirLock

HERE = Path(__file__).parent


def test_a_held_directory_is_refused_naming_its_holder_and_free_once_released(tmp_path):
    run_dir = tmp_path / "run"
    held = RunDirLock.acquire(run_dir)
    before = sorted(run_dir.iterdir())
    with pytest.raises(RunDirInUseError, match=rf"in use by another run \(pid \d+ on host {socket.gethostname()}"):
        RunDirLock.acquire(run_dir)
    assert sorted(run_dir.iterdir()) == before  # the refused start touched nothing
    (run_dir / "config.toml").write_text("")  # the run wrote something: the directory stays
    held.release()
    RunDirLock.acquire(run_dir).release()
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.toml"]


def test_a_lock_that_only_created_the_directory_leaves_no_trace(tmp_path):
    RunDirLock.acquire(tmp_path / "new" / "run").release()  # e.g. a start refused for bad data
    assert list(tmp_path.iterdir()) == []


def test_a_killed_holder_does_not_block_the_next_start(tmp_path):
    run_dir = tmp_path / "run"
    done = run_python("-c", "import os, signal, sys; from trinity_train.runlock import RunDirLock; "
                      "RunDirLock.acquire(sys.argv[1]); os.kill(os.getpid(), signal.SIGKILL)", run_dir)
    assert done.returncode == -9 and "pid" in (run_dir / ".lock").read_text()
    RunDirLock.acquire(run_dir).release()


@pytest.fixture
def config_file(corpus, tmp_path):
    path = tmp_path / "config.toml"
    save_config(run_config(corpus, tmp_path / "run", train={"steps": 8, "micro_batch_size": 2}, eval={"every": 4},
                           checkpoint={"every": 4}), path)
    return path


def start(pool, gate, config_file):
    """A run on the shared directory, paused after its first step until `gate` exists."""
    return pool.submit(run_python, HERE / "paused_run.py", gate, "train", "--config", config_file,
                       env=ONE_THREAD_ENV)


def assert_refused(done):
    assert_one_line_error(done.returncode, done.stderr, 1, "is in use by another run (pid ",
                          f"on host {socket.gethostname()}", "choose another --run.dir")


def assert_whole(run_dir):
    """The run trained every step once, validated and checkpointed when due, and every checkpoint
    verifies."""
    run = RunDir(run_dir)
    assert [r["step"] for r in run.read_metrics(RecordKind.TRAIN)] == list(range(1, 9))
    assert [r["step"] for r in run.read_metrics(RecordKind.VAL)] == [0, 4, 8]
    assert len(run.read_events(EventName.RUN_START)) == len(run.read_events(EventName.RUN_END)) == 1
    assert [e["step"] for e in run.read_events(EventName.CHECKPOINT)] == [4, 8]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_00000004", "step_00000008"]
    for path in run.checkpoints.iterdir():
        check_integrity(path)


@pytest.mark.slow  # two console-script runs on one directory
def test_two_runs_started_together_on_one_directory(config_file, tmp_path):
    gate = tmp_path / "gate"
    with ThreadPoolExecutor(2) as pool:
        runs = [start(pool, gate, config_file), start(pool, gate, config_file)]
        finished, _ = wait(runs, timeout=600, return_when=FIRST_COMPLETED)  # the refused one; the other waits
        gate.touch()
        results = [run.result() for run in (*finished, *(set(runs) - finished))]
    assert_refused(results[0])
    assert results[1].returncode == 0, results[1].stderr
    assert_whole(tmp_path / "run")


@pytest.mark.slow  # two console-script runs on one directory
def test_a_run_started_on_the_directory_of_a_running_one(config_file, tmp_path):
    gate, run = tmp_path / "gate", RunDir(tmp_path / "run")
    with ThreadPoolExecutor(1) as pool:
        first = start(pool, gate, config_file)
        deadline = time.monotonic() + 600
        while not run.read_metrics(RecordKind.TRAIN) and not first.done() and time.monotonic() < deadline:
            time.sleep(0.2)
        second = run_python("-m", "trinity_train.cli", "train", "--config", config_file, env=ONE_THREAD_ENV)
        gate.touch()
        assert first.result().returncode == 0, first.result().stderr
    assert_refused(second)
    assert_whole(run.path)
