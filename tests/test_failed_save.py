"""A checkpoint write that fails (the `fail_save` drill: an I/O error from the storage writer on a
rank, after DCP planned the save with every rank) is recorded and the run trains on: one process
and two gloo ranks (the failure on rank 1 only), synchronous and asynchronous saves. The earlier
checkpoint still verifies, the failed one leaves nothing behind, the next save succeeds, and
`checkpoint.max_failed_saves` failed saves in a row stop the run with the save's error. The final
save's failure is a failure (exit 1, one line naming the newest checkpoint), and a resume from
there writes it."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, cli_in_process, run_config
from trinity_harness.ranks import rank_trainer
from trinity_train.checkpoint import verify_checkpoint
from trinity_train.config import save_config
from trinity_train.errors import CheckpointError
from trinity_train.records import EventName
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer


def failing_save_config(corpus, run_dir, async_save: bool, rank: int = -1, last: int = -1, max_failed: int = 3,
                        first: int = 4):
    return run_config(corpus, run_dir, train={"steps": 6, "micro_batch_size": 1, "grad_accum": 1}, eval={"every": 0},
                      checkpoint={"every": 2, "keep": 5, "async_save": async_save, "max_failed_saves": max_failed},
                      metrics={"layer_stats_every": 0},
                      stability={"inject": [{"fault": "fail_save", "first": first, "last": last, "rank": rank}]})


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


@pytest.mark.slow  # two-rank runs (4-8 s each)
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


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_final_save_fails_the_run_naming_the_newest_checkpoint(corpus, tmp_path, capsys, async_save):
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    save_config(failing_save_config(corpus, run_dir, async_save, first=6), config)
    code, err = cli_in_process(capsys, "train", "--config", config)
    newest = RunDir(run_dir).checkpoints / "step_00000004"
    assert_one_line_error(code, err, 1, "could not be written", "the final checkpoint (step 6) was not written",
                          f"the newest checkpoint is '{newest}' (step 4)", "train the last 2 step(s) again",
                          "--checkpoint.resume=auto")
    run = RunDir(run_dir)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_00000002", "step_00000004"]  # no .tmp
    assert not run.read_events(EventName.RUN_END)  # a failed run, not an ended one
    # What the line advises: the resume trains the last steps again and writes the final checkpoint.
    code, err = cli_in_process(capsys, "train", "--config", config, "--checkpoint.resume=auto",
                               "--stability.inject=[]")
    assert code == 0, err
    verify_checkpoint(run.checkpoints / "step_00000006")
