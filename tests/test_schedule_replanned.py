"""A resume that changes `train.steps` of a decaying schedule re-plans it at the same position
(optim/schedule.py); the run records what that chose (`schedule_replanned`) and prints it."""

import pytest

from conftest import run_config
from trinity_train.optim.schedule import describe_replanned, lr_multiplier, replanned
from trinity_train.records import EventName


def cfg(steps, schedule="cosine", **optim):
    return run_config("data", "run", train={"steps": steps},
                      optim={"schedule": schedule, "warmup_steps": 2, "lr": 1e-3, "min_lr_ratio": 0.05, **optim})


def test_extending_a_finished_cosine_run_records_the_jump():
    replan = replanned(cfg(20), cfg(200), step=20)
    assert replan["event"] == EventName.SCHEDULE_REPLANNED
    assert replan["from_steps"] == 20 and replan["to_steps"] == 200 and replan["step"] == 20
    assert replan["lr_from"] == pytest.approx(1e-3 * lr_multiplier(19, cfg(20).optim, 20))
    assert replan["lr_to"] == pytest.approx(1e-3 * lr_multiplier(20, cfg(200).optim, 200))
    assert replan["lr_to"] > 10 * replan["lr_from"]
    line = describe_replanned(replan)
    assert line.startswith("notice: train.steps 20 -> 200 re-plans the cosine schedule at step 20")
    assert f"from {replan['lr_from']:.3g} to {replan['lr_to']:.3g}" in line and "\n" not in line


@pytest.mark.parametrize("previous, resumed", [(cfg(20), cfg(20)), (cfg(20, "constant"), cfg(200, "constant"))])
def test_nothing_is_recorded_when_the_rates_do_not_depend_on_the_length(previous, resumed):
    assert replanned(previous, resumed, step=10) is None


def test_a_resume_that_extends_the_run_records_and_prints_it(corpus, tmp_path, capsys):
    from trinity_train.rundir import RunDir
    from trinity_train.train import Trainer

    run_dir = tmp_path / "run"

    def config(steps, resume="none"):
        return run_config(corpus, run_dir, train={"steps": steps, "micro_batch_size": 2}, eval={"every": 0},
                          optim={"schedule": "cosine", "warmup_steps": 1}, checkpoint={"every": 2, "resume": resume})

    Trainer(config(2)).run()
    Trainer(config(4, resume="auto")).run()
    (replan,) = RunDir(run_dir).read_events(EventName.SCHEDULE_REPLANNED)
    assert (replan["step"], replan["from_steps"], replan["to_steps"]) == (2, 2, 4)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: train.steps")]
    assert notices == [describe_replanned(replan)]
