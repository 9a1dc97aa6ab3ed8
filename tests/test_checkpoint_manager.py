"""Training checkpoints: exact round trip, atomic commit, retention, resume selection, async save."""

import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from helpers import flip_byte
from trinity_train.checkpoint import (CheckpointManager, ModelState, OptimizerState, RNGState, load_checkpoint,
                                      save_model_checkpoint)
from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.layout import list_checkpoints
from trinity_train.config import CheckpointConfig, Config
from trinity_train.errors import CheckpointError
from trinity_train.optim.schedule import ConfiguredSchedule


class Counter:
    """A plain Stateful component, like the loader or the trainer's counters."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "history": [self.value * 0.5, float(self.value)]}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def toy_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model.register_buffer("expert_bias", torch.randn(4))
    return model


def trained_state(seed=0, steps=2):
    model = toy_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ConfiguredSchedule(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def components(model, opt, sched, counter):
    return {"model": ModelState(model), "optim": OptimizerState(model, opt), "scheduler": sched,
            "trainer": counter, "rng": RNGState()}


def manager(tmp_path, **kw):
    return CheckpointManager(tmp_path / "run", CheckpointConfig(**kw))


def test_round_trip_restores_every_component_exactly(tmp_path):
    model, opt, sched = trained_state(seed=0)
    mgr = manager(tmp_path)
    torch.manual_seed(77)
    random.seed(77)
    np.random.seed(77)
    path = mgr.save(3, components(model, opt, sched, Counter(3)), Config())
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    model2, opt2, sched2 = trained_state(seed=1, steps=1)
    counter2 = Counter(0)
    load_checkpoint(path, components(model2, opt2, sched2, counter2), Config())

    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in s1:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[i][key], s2[i][key])
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert counter2.value == 3
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1] and np.random.rand() == expected_draws[2]


def test_checkpoint_is_only_visible_once_complete(tmp_path):
    model, opt, sched = trained_state()
    mgr = manager(tmp_path, resume="auto")
    mgr.save(1, components(model, opt, sched, Counter(1)), Config())
    # Simulate saves interrupted before meta.json: a .tmp directory and a directory missing meta.json.
    good = mgr.checkpoints_dir / "step_00000001"
    shutil.copytree(good, mgr.checkpoints_dir / "step_00000002.tmp")
    shutil.copytree(good, mgr.checkpoints_dir / "step_00000003")
    (mgr.checkpoints_dir / "step_00000003" / "meta.json").unlink()

    assert mgr.resume_path() == good
    assert [s for s, _ in list_checkpoints(mgr.checkpoints_dir)] == [1]
    removed = mgr.remove_interrupted_saves()
    assert [p.name for p in removed] == ["step_00000002.tmp"]
    with pytest.raises(CheckpointError, match="incomplete.*meta.json"):
        load_checkpoint(mgr.checkpoints_dir / "step_00000003", components(model, opt, sched, Counter()), Config())


def test_retention_keeps_the_newest(tmp_path):
    model, opt, sched = trained_state()
    mgr = manager(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        mgr.save(step, components(model, opt, sched, Counter(step)), Config())
    assert [s for s, _ in list_checkpoints(mgr.checkpoints_dir)] == [30, 40]
    assert sorted(p.name for p in mgr.checkpoints_dir.iterdir()) == ["step_00000030", "step_00000040"]


def test_retention_counts_only_sound_checkpoints_and_deletes_no_damaged_one(tmp_path):
    model, opt, sched = trained_state()
    mgr = manager(tmp_path, keep=1)
    for step in (10, 30):
        mgr.save(step, components(model, opt, sched, Counter(step)), Config())
    flip_byte(next((mgr.checkpoints_dir / "step_00000030").glob("*.distcp")), 10)
    mgr.save(27, components(model, opt, sched, Counter(27)), Config())  # a resume from before 30
    assert [s for s, _ in list_checkpoints(mgr.checkpoints_dir)] == [27, 30]  # the damaged 30 did not count
    mgr.save(40, components(model, opt, sched, Counter(40)), Config())
    assert [s for s, _ in list_checkpoints(mgr.checkpoints_dir)] == [30, 40]


def test_a_save_without_dcp_metadata_is_never_given_its_final_name(tmp_path, monkeypatch):
    model, opt, sched = trained_state()
    mgr, save = manager(tmp_path), dcp_io.save

    def save_then_lose_metadata(state, path, storage_writer=None):  # as when another process cleaned up our directory
        save(state, path)
        (path / ".metadata").unlink()

    monkeypatch.setattr(dcp_io, "save", save_then_lose_metadata)
    with pytest.raises(CheckpointError, match="could not be committed: .* has no DCP .metadata"):
        mgr.save(5, components(model, opt, sched, Counter(5)), Config())
    assert list(mgr.checkpoints_dir.iterdir()) == []


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt, sched = trained_state()
    mgr = manager(tmp_path)
    mgr.save(5, components(model, opt, sched, Counter(1)), Config())
    path = mgr.save(5, components(model, opt, sched, Counter(2)), Config())
    counter = Counter()
    load_checkpoint(path, {"trainer": counter}, Config())
    assert counter.value == 2


def test_resume_selection(tmp_path):
    model, opt, sched = trained_state()
    assert manager(tmp_path, resume="none").resume_path() is None
    assert manager(tmp_path, resume="auto").resume_path() is None  # nothing saved yet: start fresh
    path = manager(tmp_path).save(7, components(model, opt, sched, Counter()), Config())
    assert manager(tmp_path, resume="auto").resume_path() == path
    assert manager(tmp_path, resume=str(path)).resume_path() == path
    with pytest.raises(CheckpointError, match="does not exist"):
        manager(tmp_path, resume=str(tmp_path / "nope")).resume_path()


def test_async_save_writes_the_state_as_of_the_call(tmp_path):
    model, opt, sched = trained_state()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = manager(tmp_path, async_save=True)
    path = mgr.save(4, components(model, opt, sched, Counter(4)), Config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training continues while the save is in flight
    assert mgr.wait() == path
    assert list_checkpoints(mgr.checkpoints_dir) == [(4, path)]
    restored = toy_model(seed=5)
    load_checkpoint(path, {"model": ModelState(restored)}, Config())
    for k, v in restored.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_incompatible_checkpoints_are_refused_with_a_reason(tmp_path):
    model, opt, sched = trained_state()
    path = manager(tmp_path).save(2, components(model, opt, sched, Counter()), Config())

    other_cfg = Config()
    other_cfg.model.hidden_size = 512
    with pytest.raises(CheckpointError, match="different model.*model.hidden_size: 256 -> 512"):
        load_checkpoint(path, {"model": ModelState(model)}, other_cfg)

    wider = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3))
    wider.register_buffer("expert_bias", torch.zeros(4))
    with pytest.raises(CheckpointError, match="could not be loaded.*[Ss]ize mismatch"):
        load_checkpoint(path, {"model": ModelState(wider)}, Config())

    with pytest.raises(CheckpointError, match="lacks loader"):
        load_checkpoint(path, {"model": ModelState(model), "loader": Counter()}, Config())


def test_resuming_from_weights_only_points_to_init_from(tmp_path):
    model, opt, sched = trained_state()
    save_model_checkpoint(model, Config(), tmp_path / "weights")
    with pytest.raises(CheckpointError, match="lacks optim.*weights only.*--checkpoint.init_from"):
        load_checkpoint(tmp_path / "weights", components(model, opt, sched, Counter()), Config())
    with pytest.raises(CheckpointError, match="already exists"):
        save_model_checkpoint(model, Config(), tmp_path / "weights")


def test_model_compatibility_compares_resolved_architecture_only(tmp_path):
    model, opt, sched = trained_state()
    path = manager(tmp_path).save(2, {"model": ModelState(model)}, Config())
    explicit = Config()
    explicit.model.global_every, explicit.model.norm_eps = 4, 1e-5  # what 0 resolves to for trinity
    explicit.model.expert_impl, explicit.model.aux_loss_alpha = "loop", 1e-4  # training-only settings
    load_checkpoint(path, {"model": ModelState(model)}, explicit)
    explicit.model.global_every = 2
    with pytest.raises(CheckpointError, match="model.global_every: 4 -> 2"):
        load_checkpoint(path, {"model": ModelState(model)}, explicit)
