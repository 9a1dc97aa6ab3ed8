"""A cell's measurements, from a run directory written by hand (docs/CONTRACT.md "Run directory")
with a skipped non-finite step, a loss spike ending in a rollback, and "layers" records whose
values are known, so every number can be checked exactly."""

from __future__ import annotations

import math

import pytest

from trinity_harness.synthetic_run import append_jsonl
from trinity_train.config import Config, TrainConfig
from trinity_train.rundir import RunDir
from trinity_train.study.measure import log_slope, measure_cell, spread
from trinity_train.records import EventName, RecordKind

TOKENS_PER_STEP = 32
PROFILE = {"grad_norm_attn": [6.0, 3.0, 1.5, 0.75], "grad_norm_ffn": [8.0, 4.0, 2.0, 1.0],
           "residual_rms": [1.0, 2.0, 4.0, 8.0], "act_kurtosis": [1.0, 5.0, 3.0, 2.0],
           "act_max_over_median": [4.0, 9.0, 6.0, 5.0],
           "norm_gain": {"attn_post_norm": [0.5, 0.5, 0.6, 0.7], "mlp_post_norm": [0.4, 0.4, 0.4, 0.4],
                         "attn_norm": [1.0] * 4, "mlp_norm": [1.0] * 4, "q_norm": [1.0] * 4, "k_norm": [1.0] * 4,
                         "final_norm": 1.0}}
OUTLIER = {**PROFILE, "act_kurtosis": [100.0] * 4}


def write_run(path) -> RunDir:
    """25 iterations to step 20: iteration 5 is non-finite (skipped); iteration 14's loss jumps by
    1.9 and iteration 16's spike (skipped) rolls back to the checkpoint of iteration 12 (step 11),
    abandoning iterations 13-16; "layers" records at iterations 2, 10, 15 (abandoned: an
    outlier), 20 and 25; validation at steps 0, 10 and 20."""
    run = RunDir(path)
    records = [{"kind": RecordKind.VAL, "iter": 0, "step": 0, "val_loss": 6.0}]
    events = [{"event": EventName.RUN_START, "step": 0, "iter": 0}]
    step = 0
    for it in range(1, 26):
        if it in (5, 16):
            nonfinite = it == 5
            records.append({"kind": RecordKind.TRAIN, "iter": it, "step": step, "loss": None if nonfinite else 9.0,
                            "grad_norm": None if nonfinite else 50.0, "skipped": True, "tokens_per_s": 1.0,
                            "tokens_seen": step * TOKENS_PER_STEP})
            if it == 16:
                events.append({"event": EventName.ROLLBACK, "iter": 16, "to_iter": 12, "from_step": step, "to_step": 11})
                step = 11
            continue
        step += 1
        records.append({"kind": RecordKind.TRAIN, "iter": it, "step": step, "loss": 5 - 0.1 * step + (2.0 if it == 14 else 0.0),
                        "grad_norm": 2.0 if step % 4 == 0 else 0.5, "skipped": False, "tokens_per_s": 1000.0 + it,
                        "tokens_seen": step * TOKENS_PER_STEP, "moe_max_load": 1 + step / 100})
        if it in (2, 10, 15, 20, 25):
            records.append({"kind": RecordKind.LAYERS, "iter": it, "step": step, **(OUTLIER if it == 15 else PROFILE)})
        if step % 10 == 0:
            records.append({"kind": RecordKind.VAL, "iter": it, "step": step, "val_loss": 6.0 - step / 10})
    events.append({"event": EventName.RUN_END, "step": step, "iter": 25})
    append_jsonl(run.metrics, records)
    append_jsonl(run.events, events)
    return run


@pytest.fixture
def measures(tmp_path):
    return measure_cell(write_run(tmp_path / "run"), Config(train=TrainConfig(steps=20, grad_clip=1.0)))


def test_loss_and_stability(measures):
    assert measures["last_step"] == 20
    assert measures["skipped_steps"] == 2 and measures["nonfinite_steps"] == 1 and measures["rollbacks"] == 1
    assert measures["halt"] is None
    assert measures["max_loss_jump"] == pytest.approx(9.0 - (5 - 1.4))  # the spike, though a rollback undid it
    # applied steps (23 of them) with a grad norm above train.grad_clip: steps 4, 8, 12 (twice), 16, 20
    assert measures["clipped_fraction"] == pytest.approx(6 / 23)
    assert measures["max_grad_norm"] == 50.0
    # main-line iterations past the first five: 6-12 and 17-25, median of 1000 + iter
    assert measures["tokens_per_s"] == pytest.approx(1017.5)
    # second half (step > 10) of the main line: steps 11 (iteration 12) and 12-20 (17-25)
    assert measures["moe_max_load"] == pytest.approx((1.11 + sum(1 + s / 100 for s in range(12, 21))) / 10)


def test_validation_at_matched_token_counts(measures):
    assert measures["val"] == [{"step": 0, "iter": 0, "tokens": 0, "val_loss": 6.0},
                               {"step": 10, "iter": 11, "tokens": 10 * TOKENS_PER_STEP, "val_loss": 5.0},
                               {"step": 20, "iter": 25, "tokens": 20 * TOKENS_PER_STEP, "val_loss": 4.0}]
    assert measures["val_loss_at"]["50%"]["val_loss"] == 5.0 and measures["val_loss_at"]["100%"]["val_loss"] == 4.0
    curve = measures["train_curve"]
    assert curve["tokens"] == sorted(curve["tokens"]) and curve["tokens"][-1] == 20 * TOKENS_PER_STEP
    assert len(curve["loss"]) == 20  # the main line's applied iterations: 1-4, 6-12 and 17-25


def test_depth_profile_at_10_50_and_100_percent(measures):
    at = measures["layers"]
    assert (at["10%"]["iter"], at["50%"]["iter"], at["100%"]["iter"]) == (2, 10, 25)
    profile = at["50%"]
    assert profile["grad_norm"] == pytest.approx([10.0, 5.0, 2.5, 1.25])  # attention and FFN together
    assert profile["spread"] == pytest.approx(8.0) and profile["log_slope"] == pytest.approx(-math.log(2))
    assert profile["spread_attn"] == pytest.approx(8.0) and profile["spread_ffn"] == pytest.approx(8.0)
    assert profile["residual_ratio"] == pytest.approx(8.0)
    assert profile["post_norm_gain"] == {"attn": [0.5, 0.5, 0.6, 0.7], "ffn": [0.4, 0.4, 0.4, 0.4]}
    assert profile["max_kurtosis"] == 5.0 and profile["max_over_median"] == 9.0
    # the abandoned iteration 15's outlier is not part of the run's main line
    assert measures["peak_kurtosis"] == 5.0


def test_a_run_without_layer_records_or_validation_has_none_there(tmp_path):
    run = RunDir(tmp_path / "run")
    append_jsonl(run.metrics, [{"kind": RecordKind.TRAIN, "iter": i, "step": i, "loss": 3.0, "grad_norm": 0.5, "skipped": False,
                                "tokens_seen": 32 * i} for i in range(1, 4)])
    m = measure_cell(run, Config(train=TrainConfig(steps=10, grad_clip=0.0)))
    assert m["layers"] == {"10%": None, "50%": None, "100%": None}
    assert m["val"] == [] and m["val_loss_at"] == {"50%": None, "100%": None}
    assert m["clipped_fraction"] is None and m["tokens_per_s"] is None and m["moe_max_load"] is None


def test_spread_and_slope_of_a_depth_profile():
    assert spread([2.0, None, 8.0, 4.0]) == 4.0 and spread([3.0]) is None and spread([0.0, 1.0]) is None
    assert log_slope([1.0, math.e, math.e ** 2]) == pytest.approx(1.0)
    assert log_slope([5.0]) is None and log_slope([None, 0.0, 2.0]) is None
