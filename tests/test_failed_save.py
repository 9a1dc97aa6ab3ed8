"""A checkpoint write that fails (the `fail_save` drill: an I/O error from the storage writer on a
rank, after DCP planned the save with every rank) is recorded and the run trains on: one process
and two gloo ranks (the failure on rank 1 only), synchronous and asynchronous saves. The earlier
checkpoint still verifies, the failed one leaves nothing behind, the next save succeeds, and
`checkpoint.max_failed_saves` failed saves in a row stop the run with the save's error."""

from __future__ import annotations

import pytest

from conftest import run_config
from ranks import rank_trainer
from trinity_train.checkpoint import verify_checkpoint
from trinity_train.errors import CheckpointError
from trinity_train.records import EventName
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer


def failing_save_config(corpus, run_dir, async_save: bool, rank: int = -1, last: int = -1, max_failed: int = 3):
    return run_config(corpus, run_dir, train={"steps": 6, "micro_batch_size": 1, "grad_accum": 1, "eval_every": 0},
                      checkpoint={"every": 2, "keep": 5, "async_save": async_save, "max_failed_saves": max_failed},
                      metrics={"layer_stats_every": 0},
                      stability={"inject": [{"fault": "fail_save", "first": 4, "last": last, "rank": rank}]})


def check_trained_on(run_dir) -> None:
    run = RunDir(run_dir)
    (failed,) = run.read_events(EventName.CHECKPOINT_FAILED)
    assert failed["step"] == 4 and "input/output error" in failed["error"] and "fail_save" in failed["error"]
    assert [e["step"] for e in run.read_events(EventName.CHECKPOINT)] == [2, 6]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_00000002", "step_00000006"]  # no .tmp
    for name in ("step_00000002", "step_00000006"):
        verify_checkpoint(run.checkpoints / name)
    assert run.read_events(EventName.RUN_END)[-1]["step"] == 6
    (drill,) = run.read_events(EventName.FAULT_INJECTED)
    assert (drill["fault"], drill["iter"]) == ("fail_save", 4)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_is_recorded_and_the_run_trains_on(corpus, tmp_path, async_save):
    Trainer(failing_save_config(corpus, tmp_path / "run", async_save)).run()
    check_trained_on(tmp_path / "run")


def fail_on_rank_one(corpus, run_dir, async_save: bool) -> int:
    rank_trainer(failing_save_config(corpus, run_dir, async_save, rank=1)).run()
    return 0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_the_job_trains_on(corpus, tmp_path, rank_pool, async_save):
    rank_pool(2).run(fail_on_rank_one, corpus, tmp_path / "run", async_save)
    check_trained_on(tmp_path / "run")


def test_failed_saves_in_a_row_stop_the_run_with_the_error(corpus, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError, match="could not be written: .*input/output error"):
        Trainer(failing_save_config(corpus, run_dir, False, last=100, max_failed=2)).run()
    run = RunDir(run_dir)
    assert [e["step"] for e in run.read_events(EventName.CHECKPOINT_FAILED)] == [4]  # the second one stops it
    verify_checkpoint(run.checkpoints / "step_00000002")
