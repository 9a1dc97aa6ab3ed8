"""A checkpoint written before a component's state grew a part (guard v3's warm-up and routing
watches) still resumes: those parts start fresh, everything else loads, the run goes on as one
that was never stopped would up to the fresh watches. A part that is not declared as added later
is still required."""

import pytest

from conftest import run_config
from trinity_train.errors import CheckpointError
from trinity_train.stability.guard import StepGuard
from trinity_train.train import train


def config(corpus, run_dir, steps):
    return run_config(corpus, run_dir, train={"steps": steps, "micro_batch_size": 2, "eval_every": 0},
                      optim={"warmup_steps": 2, "schedule": "constant"},
                      checkpoint={"every": 4, "resume": "auto"})


def save_without(monkeypatch, parts):
    """Checkpoints written from now on hold the guard's state less `parts` (as older versions did)."""
    full = StepGuard.state_dict
    monkeypatch.setattr(StepGuard, "state_dict", lambda self: {k: v for k, v in full(self).items() if k not in parts})


def test_a_checkpoint_from_before_the_guards_later_parts_resumes(corpus, tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as patch:
        save_without(patch, StepGuard.STATE_ADDED_LATER)
        train(config(corpus, tmp_path / "old", 4))
    resumed = train(config(corpus, tmp_path / "old", 8))
    assert "predates guard.early, guard.routing; that state starts fresh" in capsys.readouterr().err
    straight = train(config(corpus, tmp_path / "straight", 8))
    assert resumed.start_step == 4 and resumed.last_loss == pytest.approx(straight.last_loss, rel=1e-6)


def test_a_checkpoint_lacking_any_other_part_is_refused(corpus, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        save_without(patch, ("consecutive_skips",))
        train(config(corpus, tmp_path / "old", 4))
    with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: guard.consecutive_skips"):
        train(config(corpus, tmp_path / "old", 8))
