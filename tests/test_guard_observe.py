"""The guard in observe mode (`stability.mode = "observe"`): on the same signals it judges every
step as the acting guard does (skip, incident, rollback, halt), records what it would have done
as `guard_observed` events, and changes nothing of training: a run in observe mode is bit for bit
the run with the guard off."""

from __future__ import annotations

import math
import random

import pytest
import torch

from drill_run import drill_config
from trinity_train.config import StabilityConfig
from trinity_train.errors import ConfigError
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir
from trinity_train.stability import StepGuard
from trinity_train.train import Trainer

# Every check that can refuse a step off: the guard as if it were not there.
GUARD_OFF = {"skip_nonfinite": False, "spike_zscore": 0.0, "incident_zscore": 0.0, "loss_ceiling_margin": 0.0,
             "warmup_grad_ratio": 0.0, "routing_dead_experts": 0, "rollback_after": 0}


def signals(n: int = 160):
    """Loss and gradient norm with noise, spikes (single and in a row), a non-finite step and a
    late run of spikes long enough to ask for a rollback and then halt."""
    rng = random.Random(0)
    losses = [4.0 * math.exp(-2e-3 * t) * (1 + rng.gauss(0, 0.01)) for t in range(n)]
    norms = [1.0 * (1 + rng.gauss(0, 0.05)) for _ in range(n)]
    losses[60] *= 3.0
    norms[70] *= 50.0
    losses[80] = math.nan
    for t in range(100, 100 + 12):
        norms[t] *= 100.0
    return losses, norms


def test_observe_mode_judges_every_step_as_the_acting_guard_does():
    cfg = dict(window=64, min_history=10, rollback_after=3, max_consecutive_skips=10, calm_steps=5)
    acting = StepGuard(StabilityConfig(**cfg), warmup_steps=5, vocab_size=64)
    watching = StepGuard(StabilityConfig(mode="observe", **cfg), warmup_steps=5, vocab_size=64)
    step, actions = 0, []
    for i, (loss, norm) in enumerate(zip(*signals()), 1):
        acted = acting.judge(loss, norm, i, step)
        seen = watching.judge(loss, norm, i, step)  # the same signals, the same counters
        assert seen.apply  # observe mode never refuses a step
        assert (seen.observed or seen) == acted  # ... but knows the verdict the acting guard gave
        observed = [e for e in seen.events if e["event"] == EventName.GUARD_OBSERVED]
        assert [e["event"] for e in seen.events if e["event"] != EventName.GUARD_OBSERVED] == \
               [e["event"] for e in acted.events]  # the same incidents open and close
        if acted.apply:
            assert not observed and seen.observed is None
        else:
            assert [(e["action"], e["reason"]) for e in observed] == [(acted.action, acted.reason)]
            actions.append(acted.action)
        step += acted.apply
    assert {"skip", "rollback", "halt"} <= set(actions)  # every kind of refusal was compared


def test_the_mode_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="stability.mode: must be one of act, observe"):
        drill_config(tmp_path, tmp_path / "run", mode="watch")


def _train(corpus, run_dir, **stability):
    cfg = drill_config(corpus, run_dir, {"fault": "grad_scale", "first": 22, "factor": 1e4},
                       {"fault": "poison_random", "first": 26, "last": 29}, **stability)
    trainer = Trainer(cfg)
    trainer.run()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return RunDir(run_dir), params


@pytest.mark.slow  # ~9 s
def test_training_in_observe_mode_is_training_with_the_guard_off(corpus, tmp_path):
    observed, observed_params = _train(corpus, tmp_path / "observe", mode="observe")
    off, off_params = _train(corpus, tmp_path / "off", **GUARD_OFF)
    seen = observed.read_events(EventName.GUARD_OBSERVED)
    assert {e["action"] for e in seen} >= {"skip", "rollback"}  # the guard would have acted ...
    assert observed.read_events(EventName.SKIP) == observed.read_events(EventName.ROLLBACK) == []  # ... and did not
    losses = [(r["iter"], r["loss"], r["grad_norm"]) for r in observed.read_metrics(RecordKind.TRAIN)]
    assert losses == [(r["iter"], r["loss"], r["grad_norm"]) for r in off.read_metrics(RecordKind.TRAIN)]
    assert [r["val_loss"] for r in observed.read_metrics(RecordKind.VAL)] == \
           [r["val_loss"] for r in off.read_metrics(RecordKind.VAL)]
    assert observed_params.keys() == off_params.keys()
    assert all(torch.equal(observed_params[k], off_params[k]) for k in off_params)
