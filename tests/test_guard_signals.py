"""The guard's signals are data (trinity_train/signals.py). A third one, added here as a real one
would be added (an entry in `signals.SIGNALS` with its measurement, and its sigma floor in the
`stability` config: two files, and docs/CONTRACT.md for its two JSON names), is measured by the
step, judged by the guard (its window, z-score, spike reason, incident), kept in the guard's
checkpoint state and written to train records, skip events, incident reports and their table,
with no other code changed."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import run_config
from trinity_train import signals
from trinity_train.checkpoint.integrity import read_dcp_metadata
from trinity_train.checkpoint.layout import list_checkpoints
from trinity_train.config import StabilityConfig
from trinity_train.files import read_jsonl
from trinity_train.records import EventName, RecordKind, event, train_record
from trinity_train.stability import StepGuard
from trinity_train.stability.incidents import format_table, signal_rows
from trinity_train.step import StepTotals
from trinity_train.train import Trainer


def max_expert_load(totals: StepTotals) -> float:
    """The busiest expert's tokens over the mean, in the most unbalanced MoE layer."""
    counts = totals.tokens_per_expert.double()
    return float((counts.max(dim=-1).values / counts.mean(dim=-1).clamp_min(1e-9)).max())


LOAD = signals.Signal("max_expert_load", "max_expert_load_sigma_floor", "load_spike", "max load", "load z", "8.3f",
                      measure=max_expert_load)


@pytest.fixture(autouse=True)
def three_signals(monkeypatch):
    monkeypatch.setattr(signals, "SIGNALS", signals.SIGNALS + (LOAD,))


def with_load_floor(cfg: StabilityConfig) -> StabilityConfig:
    cfg.max_expert_load_sigma_floor = 0.02  # the config key a real signal adds to StabilityConfig
    return cfg


def steady(n: int, seed: int, level: float, noise: float) -> list[float]:
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0, noise)) for _ in range(n)]


def test_the_guard_judges_a_third_signal_like_the_others():
    guard = StepGuard(with_load_floor(StabilityConfig(rollback_after=0)))
    losses, norms, loads = steady(150, 1, 3.0, 0.01), steady(150, 2, 1.0, 0.05), steady(150, 3, 1.5, 0.01)
    loads[120] *= math.exp(10 * 0.02)  # 10 sigma at the floor
    verdicts = [guard.judge_signals({"loss": loss, "grad_norm": norm, "max_expert_load": load}, i + 1, i)
                for i, (loss, norm, load) in enumerate(zip(losses, norms, loads))]
    refused = [i for i, v in enumerate(verdicts) if not v.apply]
    assert refused == [120] and verdicts[120].reason == "load_spike"
    assert verdicts[120].max_expert_load_z >= 6 and abs(verdicts[120].loss_z) < 3
    opened = [e for v in verdicts for e in v.events if e["event"] == EventName.INCIDENT_OPEN]
    assert opened[0]["iter"] == 121 and opened[0]["signal"] == "max_expert_load"
    assert math.log(loads[120]) not in [v for _, v in guard.max_expert_load.points]  # kept out of its window

    state = guard.state_dict()
    assert {"loss", "grad_norm", "max_expert_load"} <= state.keys()
    restored = StepGuard(with_load_floor(StabilityConfig(rollback_after=0)))
    restored.load_state_dict(state)
    assert restored.max_expert_load.points == guard.max_expert_load.points


def test_a_third_signal_is_written_and_reported_under_its_own_names():
    guard = StepGuard(with_load_floor(StabilityConfig(mode="observe")))
    values = {"loss": math.nan, "grad_norm": 1.0, "max_expert_load": 1.7}
    verdict = guard.judge_signals(values, 1, 0)
    observed = [e for e in verdict.events if e["event"] == EventName.GUARD_OBSERVED][0]
    assert observed["max_expert_load"] == 1.7 and "max_expert_load_z" in observed

    fields = signals.fields(values, verdict.zscores)
    skip = event(EventName.SKIP, iter=1, step=0, batch=0, reason="nonfinite", incident="incidents/00000001.json",
                 **fields)
    assert list(skip)[5:11] == ["loss", "grad_norm", "max_expert_load", "loss_z", "grad_norm_z", "max_expert_load_z"]
    rows = signal_rows([{"iter": 1, "step": 0, "skipped": True, **fields}])
    assert rows[0]["max_expert_load"] == 1.7 and "max_expert_load_z" in rows[0]
    table = format_table([{"iter": 1, "step": 0, "action": "skip", "reason": "nonfinite", "signals": rows}])
    assert "max load" in table and "load z" in table and "1.700" in table


def test_the_step_measures_a_third_signal_and_the_run_records_and_checkpoints_it(corpus, tmp_path):
    counts = torch.tensor([[30.0, 10.0], [20.0, 20.0]])
    totals = StepTotals(3.0, 0.0, 0.0, 80, counts, 1.0, torch.tensor(1.0), None)
    assert signals.measured(totals) == {"loss": 3.0, "grad_norm": 1.0, "max_expert_load": 1.5}

    cfg = run_config(corpus, tmp_path / "run", train={"steps": 4}, checkpoint={"every": 2})
    with_load_floor(cfg.stability)
    Trainer(cfg).run()
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == RecordKind.TRAIN]
    assert len(records) == 4 and all(r["max_expert_load"] >= 1.0 and "max_expert_load_z" in r for r in records)
    assert train_record(**{k: v for k, v in records[0].items() if k != "kind"}) == {
        k: v for k, v in records[0].items() if k != "kind"}  # the shape has its two fields
    _, newest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert any(key.startswith("guard.max_expert_load.") for key in read_dcp_metadata(newest).state_dict_metadata)
