"""The training loop on a tiny Trinity MoE and a tiny prepared corpus: exact resume, gradient
accumulation, skipped steps, metrics, run-directory rules, init_from and activation checkpointing."""

import json
import math

import pytest
import torch

from conftest import run_config
from helpers import StopAfterStep, poison_batches, stop_after
from trinity_train.checkpoint import ModelState, save_model_checkpoint
from trinity_train.checkpoint.layout import list_checkpoints
from trinity_train.errors import ConfigError
from trinity_train.stability import TrainingDivergedError
from trinity_train.files import read_jsonl
from trinity_train.train import Trainer, build_model_for_training, train
from trinity_train.records import EventName, RecordKind

def tiny_config(corpus, run_dir, **sections):
    base = {
        "train": {"steps": 6, "micro_batch_size": 2, "grad_accum": 2}, "eval": {"every": 3, "batches": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_fraction": 0.5},  # the lr changes every step
        "checkpoint": {"every": 2, "keep": 5},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return run_config(corpus, run_dir, **base)


def train_records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == RecordKind.TRAIN]


def val_records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == RecordKind.VAL]


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_reproduces_an_uninterrupted_run_exactly(corpus, tmp_path, async_save):
    straight = Trainer(tiny_config(corpus, tmp_path / "straight"))
    straight.run()
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(tmp_path / "straight")]
    assert [s for s, _, _ in expected] == [1, 2, 3, 4, 5, 6]

    interrupted = tmp_path / "interrupted"
    with pytest.raises(StopAfterStep):
        Trainer(tiny_config(corpus, interrupted, checkpoint={"async_save": async_save}),
                callbacks=[stop_after(4)]).run()
    if async_save:  # the in-flight save of step 4 died with the process: resume from step 2
        assert [s for s, _ in list_checkpoints(interrupted / "checkpoints")] == [2]
    resumed = Trainer(tiny_config(corpus, interrupted, checkpoint={"resume": "auto", "async_save": async_save}))
    assert resumed.resume_from.name == ("step_00000002" if async_save else "step_00000004")
    resumed.run()

    assert [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(interrupted)] == expected
    assert val_records(interrupted) == val_records(tmp_path / "straight")
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    events = [json.loads(line)["event"] for line in (interrupted / "events.jsonl").read_text().splitlines()]
    assert EventName.RESUME in events


def test_gradient_accumulation_equals_one_large_batch(corpus, tmp_path):
    one = Trainer(tiny_config(corpus, tmp_path / "one", train={"steps": 2, "micro_batch_size": 4, "grad_accum": 1}, eval={"every": 0}))
    one.run()
    four = Trainer(tiny_config(corpus, tmp_path / "four", train={"steps": 2, "micro_batch_size": 1,
                                                                 "grad_accum": 4}, eval={"every": 0}))
    four.run()
    for a, b in zip(train_records(tmp_path / "one"), train_records(tmp_path / "four")):
        assert a["tokens"] == b["tokens"] == 4 * 16
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for (name, a), (_, b) in zip(one.model.state_dict().items(), four.model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_metrics_and_validation_lines(corpus, tmp_path):
    trainer = Trainer(tiny_config(corpus, tmp_path / "run", train={"steps": 6}, eval={"every": 3}))
    summary = trainer.run()
    records = train_records(tmp_path / "run")
    assert len(records) == 6
    for r in records:
        for key in ("iter", "step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "moe_max_load",
                    "moe_min_load", "moe_cv", "moe_cv_per_layer"):
            assert key in r, key
        assert len(r["moe_cv_per_layer"]) == 3  # layers 1-3 are MoE
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["skipped"] is False
    # Warmup over 2 steps, then WSD's decay over the last 3 of 6.
    assert [r["lr"] for r in records] == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3, 2e-3, 1e-3])
    vals = val_records(tmp_path / "run")
    assert [v["step"] for v in vals] == [0, 3, 6]
    assert vals[0]["val_loss"] == pytest.approx(math.log(320), abs=0.3)  # an untrained model guesses
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert summary.first_val_loss == vals[0]["val_loss"] and summary.last_val_loss == vals[-1]["val_loss"]
    assert (tmp_path / "run" / "config.toml").is_file()
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 4, 6]
    # The expert biases moved once per step, by the sign rule's 1e-2 (centred) each time.
    biases = torch.stack([moe.expert_bias for moe in trainer.model.moe_layers])
    assert biases.abs().max() > 0 and biases.abs().max() <= 6 * 1e-2 * 2


def test_non_finite_step_is_skipped_and_recorded(corpus, tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(corpus, tmp_path / "run", train={"steps": 4}, eval={"every": 0},
                                  checkpoint={"every": 0}))
    forward = trainer.model.forward
    calls = {"n": 0}

    def poisoned_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:  # first micro-batch of iteration 3
            out.ce_sum = out.ce_sum * float("nan")
        return out

    monkeypatch.setattr(trainer.model, "forward", poisoned_forward)
    summary = trainer.run()

    records = train_records(tmp_path / "run")
    assert [(r["iter"], r["step"], r["skipped"]) for r in records] == [
        (1, 1, False), (2, 2, False), (3, 2, True), (4, 3, False), (5, 4, False)]
    assert records[2]["loss"] is None and records[2]["skip_reason"] == "nonfinite"
    assert summary.skipped_steps == 1 and summary.step == 4
    ledger = json.loads((tmp_path / "run" / "skip_ledger.json").read_text())
    assert [(r["start"], r["end"]) for r in ledger["ranges"]] == [(2, 3)]  # global batch 2 (0-based)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.scheduler.last_epoch == 4  # the skipped step did not advance the schedule


# Back to the newest checkpoint at or before the onset, nothing skipped beyond the trigger, every
# incident treated as a first one, and no LR back-off (the default's would make the runs differ).
ROLLBACK = {"rollback_after": 2, "max_consecutive_skips": 4, "rollback_lookback": 0, "skip_extra_batches": 0,
            "repeat_window": 0, "lr_backoff": 1.0}


def test_rollback_equals_a_run_that_skipped_those_batches_from_the_start(corpus, tmp_path):
    # Checkpoints at steps 2 and 4 (loader position 4); batch 4 trains step 5, batches 5 and 6 are
    # poisoned: the second skip in a row rolls back to step 4 and rules out batches 4-6.
    rolled = Trainer(tiny_config(corpus, tmp_path / "rolled", train={"steps": 8}, stability=ROLLBACK))
    poison_batches(rolled, {5, 6})
    summary = rolled.run()
    assert summary.step == 8 and summary.skipped_steps == 2 and summary.rollbacks == 1
    assert "2 skipped, 1 rolled back)" in summary.describe()

    events = [json.loads(line) for line in (tmp_path / "rolled" / "events.jsonl").read_text().splitlines()]
    rollback = next(e for e in events if e["event"] == EventName.ROLLBACK)
    assert (rollback["from_step"], rollback["to_step"], rollback["skipped_batches"]) == (5, 4, [4, 7])
    assert rollback["checkpoint"].endswith("step_00000004") and rollback["iter"] == 7
    ledger = json.loads((tmp_path / "rolled" / "skip_ledger.json").read_text())
    assert [(r["start"], r["end"]) for r in ledger["ranges"]] == [(5, 6), (6, 7), (4, 7)]
    records = train_records(tmp_path / "rolled")
    assert [r["iter"] for r in records] == list(range(1, 12))  # iterations stay unique
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 5, 5, 6, 7, 8]

    skipped = Trainer(tiny_config(corpus, tmp_path / "skipped", train={"steps": 8},
                                  data={"skip_ranges": [[4, 7]]}))
    skipped.run()
    tail = lambda run: [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(run)][-4:]  # noqa: E731
    assert tail(tmp_path / "rolled") == tail(tmp_path / "skipped")
    for (name, a), (_, b) in zip(rolled.model.state_dict().items(), skipped.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_rollback_allowance_and_no_checkpoint_yet(corpus, tmp_path):
    # No rollback is possible before the first checkpoint: the streak goes on to the usual stop.
    early = Trainer(tiny_config(corpus, tmp_path / "early", train={"steps": 8}, stability=ROLLBACK))
    poison_batches(early, set(range(0, 10)))
    with pytest.raises(TrainingDivergedError, match="4 steps in a row"):
        early.run()
    events = [json.loads(line)["event"] for line in (tmp_path / "early" / "events.jsonl").read_text().splitlines()]
    assert EventName.ROLLBACK_UNAVAILABLE in events and EventName.ROLLBACK not in events

    # Poison that outlives every rollback: the run stops once the allowance is spent.
    stuck = Trainer(tiny_config(corpus, tmp_path / "stuck", train={"steps": 8},
                                stability={**ROLLBACK, "max_rollbacks": 2}))
    poison_batches(stuck, set(range(2, 40)))
    with pytest.raises(TrainingDivergedError, match="after 2 rollbacks"):
        stuck.run()
    assert stuck.rollbacks == 2 and stuck.state.step == 2


def test_run_directory_of_a_different_run_is_refused(corpus, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_config(corpus, run_dir, train={"steps": 2}, eval={"every": 0}))
    with pytest.raises(ConfigError, match=r"run.dir: .* different config \(optim.lr: 0.003 -> 0.001\)"):
        Trainer(tiny_config(corpus, run_dir, train={"steps": 2}, eval={"every": 0}, optim={"lr": 1e-3}))

    # The same config again starts over: the metrics describe the new run only. How a run is
    # started or displayed (resume, progress display) is not part of what makes it different.
    train(tiny_config(corpus, run_dir, train={"steps": 2, "log_every": 5}, eval={"every": 0}))
    assert [r["iter"] for r in train_records(run_dir)] == [1, 2]

    (run_dir / "config.toml").write_text("[train]\nsteps = 'two'\n")
    with pytest.raises(ConfigError, match="config.toml this version cannot read"):
        Trainer(tiny_config(corpus, run_dir, train={"steps": 2}, eval={"every": 0}))


def test_resume_of_a_finished_run_has_nothing_to_do(corpus, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "run", train={"steps": 2}, eval={"every": 0})
    train(cfg)
    cfg.checkpoint.resume = "auto"
    summary = train(cfg)
    assert summary.describe().startswith("nothing to do")
    assert [r["iter"] for r in train_records(tmp_path / "run")] == [1, 2]


def test_init_from_starts_from_the_given_weights(corpus, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "run", train={"steps": 1, "seed": 1}, eval={"every": 0})
    donor = build_model_for_training(cfg, torch.device("cpu"))
    save_model_checkpoint(donor, cfg, tmp_path / "donor")

    cfg.train.seed = 2  # a different init, so matching weights can only come from the donor
    cfg.checkpoint.init_from = str(tmp_path / "donor")
    trainer = Trainer(cfg)
    trainer.restore()
    for (name, a), (_, b) in zip(ModelState(donor).state_dict().items(), ModelState(trainer.model).state_dict().items()):
        assert torch.equal(a, b), name


def test_activation_checkpointing_changes_nothing_but_memory(corpus, tmp_path):
    plain = Trainer(tiny_config(corpus, tmp_path / "plain", train={"steps": 2}, eval={"every": 0}))
    plain.run()
    ac = Trainer(tiny_config(corpus, tmp_path / "ac", train={"steps": 2, "activation_checkpointing": True}, eval={"every": 0}))
    ac.run()
    assert [r["loss"] for r in train_records(tmp_path / "plain")] == [r["loss"] for r in train_records(tmp_path / "ac")]
    assert list(ModelState(plain.model).state_dict()) == list(ModelState(ac.model).state_dict())
    for (name, a), (_, b) in zip(ModelState(plain.model).state_dict().items(), ModelState(ac.model).state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_autocast_trains_close_to_fp32(corpus, tmp_path):
    train(tiny_config(corpus, tmp_path / "fp32", train={"steps": 2}, eval={"every": 0}))
    train(tiny_config(corpus, tmp_path / "bf16", train={"steps": 2, "dtype": "bf16"}, eval={"every": 0}))
    for a, b in zip(train_records(tmp_path / "fp32"), train_records(tmp_path / "bf16")):
        assert a["loss"] != b["loss"] and b["loss"] == pytest.approx(a["loss"], abs=0.05)
