"""What a resume takes from the checkpoint (the schedule's position, the optimizer's moments) and
what from the config it starts with (peak learning rates, schedule length, optimizer settings)."""

import pytest

from conftest import run_config
from trinity_train.config import OptimConfig
from trinity_train.optim.schedule import lr_multiplier
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer
from trinity_train.records import EventName, RecordKind


def config(corpus, run_dir, steps, resume="none", **optim):
    return run_config(corpus, run_dir,
                      train={"steps": steps, "micro_batch_size": 2}, eval={"every": 0},
                      optim={"warmup_steps": 2, "decay_fraction": 0.5, **optim},
                      checkpoint={"every": 2, "resume": resume})


def train_records(run_dir):
    return RunDir(run_dir).read_metrics(RecordKind.TRAIN)


def expected_lr(peak, step, total, **optim):
    return peak * lr_multiplier(step, OptimConfig(warmup_steps=2, decay_fraction=0.5, **optim), total)


def test_new_peak_learning_rates_take_effect_at_a_resume(corpus, tmp_path):
    run = tmp_path / "run"
    Trainer(config(corpus, run, steps=6)).run()
    # Go back to step 2 with other peaks (the divergence advice: lower optim.lr and resume).
    resumed = config(corpus, run, steps=6, resume=str(run / "checkpoints" / "step_00000002"),
                     lr=1e-3, muon_lr=2e-3)
    Trainer(resumed).run()
    after = [r for r in train_records(run) if r["step"] > 2]
    assert [r["step"] for r in after] == [3, 4, 5, 6]
    for r in after:
        assert r["lr"] == pytest.approx(expected_lr(1e-3, r["step"] - 1, 6))
        assert r["lr_muon"] == pytest.approx(expected_lr(2e-3, r["step"] - 1, 6))
    changes = RunDir(run).read_events(EventName.CONFIG_CHANGED)[-1]["changes"]
    assert ["optim.lr", 3e-3, 1e-3] in changes and ["optim.muon_lr", 1.5e-2, 2e-3] in changes


def test_extending_a_finished_run_continues_the_schedule_for_the_new_length(corpus, tmp_path):
    run = tmp_path / "run"
    Trainer(config(corpus, run, steps=4)).run()
    assert train_records(run)[-1]["lr"] == pytest.approx(expected_lr(3e-3, 3, 4))
    Trainer(config(corpus, run, steps=6, resume="auto")).run()
    new = [r for r in train_records(run) if r["step"] > 4]
    # The schedule is re-planned for 6 steps at position 4: back in the stable phase's decay,
    # not at the finished schedule's final rate of 0.
    assert [r["lr"] for r in new] == pytest.approx([expected_lr(3e-3, 4, 6), expected_lr(3e-3, 5, 6)])
    assert all(r["lr"] > 0 for r in new)


def test_other_optimizer_settings_come_from_the_config_at_a_resume(corpus, tmp_path):
    run = tmp_path / "run"
    Trainer(config(corpus, run, steps=2)).run()
    trainer = Trainer(config(corpus, run, steps=4, resume="auto", weight_decay=0.0, beta2=0.9))
    trainer.restore()
    assert trainer.scheduler.last_epoch == 2
    for group in trainer.optimizer.param_groups:
        assert group["weight_decay"] == 0.0 and group["betas"] == (0.9, 0.9)
