"""StepGuard: which steps are skipped, and that it stops a diverged run."""

import math

import pytest

from trinity_train.config import StabilityConfig
from trinity_train.stability import StepGuard, TrainingDivergedError


def test_non_finite_loss_or_gradient_is_skipped():
    guard = StepGuard(StabilityConfig())
    assert guard.judge(2.0, 1.0, 1).apply
    assert guard.judge(math.nan, 1.0, 2).reason == "nonfinite"
    assert guard.judge(2.0, math.inf, 3).reason == "nonfinite"
    assert guard.judge(2.0, 1.0, 4).apply


def test_non_finite_steps_apply_when_skipping_is_off():
    assert StepGuard(StabilityConfig(skip_nonfinite=False)).judge(math.nan, 1.0, 1).apply


def test_spike_is_skipped_and_kept_out_of_the_history():
    guard = StepGuard(StabilityConfig(spike_zscore=3.0, window=10, min_history=4))
    for i, loss in enumerate([5.0, 5.1, 4.9, 5.0]):
        assert guard.judge(loss, 1.0, i).apply
    verdict = guard.judge(9.0, 1.0, 5)
    assert not verdict.apply and verdict.reason == "spike" and verdict.zscore > 3.0
    assert list(guard.recent_losses) == [5.0, 5.1, 4.9, 5.0]
    assert guard.judge(5.05, 1.0, 6).apply


def test_no_spike_verdict_before_enough_history():
    guard = StepGuard(StabilityConfig(spike_zscore=1.0, window=10, min_history=3))
    assert guard.judge(1.0, 1.0, 1).apply and guard.judge(1.1, 1.0, 2).apply
    assert guard.judge(100.0, 1.0, 3).apply


def test_too_many_skips_in_a_row_stop_the_run():
    guard = StepGuard(StabilityConfig(max_consecutive_skips=3))
    guard.judge(math.nan, 0.0, 1)
    guard.judge(math.nan, 0.0, 2)
    with pytest.raises(TrainingDivergedError, match="3 steps in a row.*iteration 3"):
        guard.judge(math.nan, 0.0, 3)


def test_state_round_trip():
    cfg = StabilityConfig(spike_zscore=10.0, window=5, min_history=2)
    guard = StepGuard(cfg)
    for i, loss in enumerate([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]):
        guard.judge(loss, 1.0, i)
    guard.judge(math.nan, 1.0, 7)
    restored = StepGuard(cfg)
    restored.load_state_dict(guard.state_dict())
    assert list(restored.recent_losses) == [2.0, 3.0, 4.0, 5.0, 6.0] and restored.consecutive_skips == 1
    assert restored.judge(7.5, 1.0, 8) == guard.judge(7.5, 1.0, 8)


def test_a_streak_of_skips_asks_for_a_rollback():
    guard = StepGuard(StabilityConfig(rollback_after=2, max_consecutive_skips=4))
    assert guard.judge(2.0, 1.0, 1).apply
    first = guard.judge(math.nan, 1.0, 2)
    assert not first.apply and not first.rollback
    second = guard.judge(math.nan, 1.0, 3)
    assert not second.apply and second.rollback and second.reason == "nonfinite"
    assert guard.judge(2.0, 1.0, 4) == guard.judge(2.0, 1.0, 5)  # applied steps end the streak
    assert not StepGuard(StabilityConfig()).judge(math.nan, 1.0, 1).rollback  # off by default
