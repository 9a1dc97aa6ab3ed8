"""The step guard on synthetic streams of losses and gradient norms: what it applies, skips,
opens incidents for, asks to roll back, and when it halts; and the rollback plan."""

import math
import re
import random

import pytest
import torch

from trinity_train.config import StabilityConfig
from trinity_train.data.ledger import LedgerKind, SkipRange
from trinity_train.stability import HALT_EXIT_CODE, StepGuard, TrainingDivergedError
from trinity_train.stability.detector import RollingSignal
from trinity_train.stability.rollback import LRBackoff, plan_rollback
from trinity_train.records import EventName

WARMUP = 30


def feed(guard, losses, grad_norms, start_iter=1, start_step=0, until_rollback=False):
    """Judge a stream; returns the verdicts (applied steps advance the step count)."""
    verdicts, step = [], start_step
    for i, (loss, norm) in enumerate(zip(losses, grad_norms)):
        verdict = guard.judge(loss, norm, start_iter + i, step)
        step += verdict.apply
        verdicts.append(verdict)
        if until_rollback and verdict.rollback:
            break
    return verdicts


def noisy(n, seed, level=1.0, noise=0.01, drift=0.0):
    """A positive signal: level * exp(drift * t) with relative Gaussian noise."""
    rng = random.Random(seed)
    return [level * math.exp(drift * t) * (1 + rng.gauss(0, noise)) for t in range(n)]


def guard(**changes) -> StepGuard:
    return StepGuard(StabilityConfig(**changes), warmup_steps=WARMUP)


def events(verdicts, name):
    return [e for v in verdicts for e in v.events if e["event"] == name]


def test_robust_zscore_on_log_values_with_a_sigma_floor():
    signal = RollingSignal(window=8, min_history=4, sigma_floor=0.05)
    for step in range(3):
        signal.add(1.0, step)
    assert signal.zscore(2.0, 3) is None  # not enough history
    signal.add(1.0, 3)
    # A flat course and no spread: sigma is the floor, so z = log(2) / 0.05
    assert signal.zscore(2.0, 4) == pytest.approx(math.log(2.0) / 0.05)
    assert signal.zscore(0.5, 4) < 0  # one-sided: below the course is negative, never a spike


def test_the_course_is_a_robust_line_through_the_log_values():
    # log values on a falling line with alternating noise, and one outlier the fit must ignore
    signal = RollingSignal(window=32, min_history=4, sigma_floor=1e-6)
    noise = [0.01, -0.01, 0.0] * 7
    for step, e in enumerate(noise):
        signal.add(math.exp(2.0 - 0.05 * step + e), step)
    signal.add(math.exp(5.0), 21)
    expected_line = 2.0 - 0.05 * 25
    sigma = 1.4826 * 0.01  # residuals +-0.01 and 0 (and one outlier): MAD 0.01
    on_line = signal.zscore(math.exp(expected_line), 25)
    assert abs(on_line) <= 0.01 / sigma  # extrapolated five steps on, within the noise
    assert signal.zscore(math.exp(expected_line + 0.1), 25) - on_line == pytest.approx(0.1 / sigma, rel=0.05)


def test_slow_drift_is_no_action():
    # 1000 steps: the loss falls slowly, the gradient norm creeps up 40 %, both noisy.
    g = guard()
    verdicts = feed(g, noisy(1000, 1, level=4.0, noise=0.01, drift=-3e-4), noisy(1000, 2, noise=0.08, drift=3.4e-4))
    assert all(v.apply for v in verdicts)
    assert not events(verdicts, EventName.INCIDENT_OPEN) or all(e["z"] < 6 for e in events(verdicts, EventName.INCIDENT_OPEN))
    assert not any(v.rollback for v in verdicts)


def test_one_10_sigma_loss_spike_is_one_skip():
    losses, norms = noisy(300, 3, level=3.0, noise=0.01), noisy(300, 4, noise=0.05)
    losses[200] *= math.exp(10 * 0.02)  # 10 sigma at the sigma floor of log(loss)
    g = guard()
    verdicts = feed(g, losses, norms)
    skipped = [i for i, v in enumerate(verdicts) if not v.apply]
    assert skipped == [200] and verdicts[200].reason == "loss_spike" and verdicts[200].loss_z >= 6
    assert len(g.loss.points) == 128 and math.log(losses[200]) not in [v for _, v in g.loss.points]  # kept out
    opened, closed = events(verdicts, EventName.INCIDENT_OPEN), events(verdicts, EventName.INCIDENT_CLOSE)
    assert [(e["iter"], e["signal"]) for e in opened] == [(201, "loss")]
    assert [e["onset_iter"] for e in closed] == [201] and closed[0]["iter"] == 201 + 20


def test_a_gradient_norm_spike_with_a_flat_loss_is_skipped():
    losses, norms = noisy(200, 5, level=3.0, noise=0.01), noisy(200, 6, noise=0.05)
    norms[150] *= 50
    verdicts = feed(guard(), losses, norms)
    assert [i for i, v in enumerate(verdicts) if not v.apply] == [150]
    assert verdicts[150].reason == "grad_spike" and verdicts[150].grad_norm_z > 6
    assert abs(verdicts[150].loss_z) < 3


def test_slow_divergence_opens_an_incident_then_asks_for_a_rollback():
    # From step 150 on, the loss climbs 1 % per step: each value is only a little above the last,
    # but values at incident level stay out of the window, so the rise is judged against the calm
    # baseline and is skipped once it is 6 sigma above it.
    losses = noisy(150, 7, level=3.0, noise=0.01) + [3.0 * 1.01 ** t for t in range(1, 60)]
    norms = noisy(len(losses), 8, noise=0.05)
    g = guard(rollback_after=3, max_consecutive_skips=10)
    verdicts = feed(g, losses, norms, until_rollback=True)
    opened = events(verdicts, EventName.INCIDENT_OPEN)
    assert len(opened) == 1 and opened[0]["signal"] == "loss"
    onset = opened[0]["iter"]
    first_skip = next(i for i, v in enumerate(verdicts) if not v.apply)
    assert 150 < onset - 1 < first_skip  # the incident opens before the first skip
    rollback = verdicts[-1]
    assert rollback.rollback and rollback.onset_iter == onset and rollback.onset_step == onset - 1
    assert [v.apply for v in verdicts[first_skip:]] == [False, False, False]


def test_a_divergence_that_stays_below_the_spike_threshold_asks_for_a_rollback():
    # From step 150 on the loss sits 8 % above its course (z ~4 at the sigma floor: an incident,
    # never a 6-sigma skip): the 20th (calm_steps) step at incident level is refused as `drift`
    # and asks for a rollback at once, with no skip before it.
    losses = noisy(150, 7, level=3.0, noise=0.01) + [v * 1.08 for v in noisy(40, 9, level=3.0, noise=0.005)]
    norms = noisy(len(losses), 8, noise=0.05)
    verdicts = feed(guard(rollback_after=3, max_consecutive_skips=10), losses, norms, until_rollback=True)
    (opened,) = events(verdicts, EventName.INCIDENT_OPEN)
    assert opened["iter"] == 151 and opened["signal"] == "loss" and 3 <= opened["z"] < 6
    refused = [(i, v.reason) for i, v in enumerate(verdicts) if not v.apply]
    assert refused == [(150 + 19, "drift")]
    assert verdicts[-1].rollback and verdicts[-1].onset_iter == 151
    # Off where z-scores skip nothing or rollbacks are off (the drift verdict is a rollback's).
    for off in ({"spike_zscore": 0.0}, {"rollback_after": 0}):
        assert all(v.apply for v in feed(guard(**{"rollback_after": 3, "max_consecutive_skips": 10, **off}),
                                         losses, norms))
    # In observe mode the same verdict is reported and training goes on; the count starts again.
    observed = feed(guard(rollback_after=3, max_consecutive_skips=10, mode="observe"), losses, norms)
    assert all(v.apply for v in observed)
    assert [(i, e["action"], e["reason"]) for i, v in enumerate(observed) for e in v.events
            if e["event"] == EventName.GUARD_OBSERVED] == [(169, "rollback", "drift"), (189, "rollback", "drift")]


def test_nan_is_skipped_and_opens_an_incident_even_in_warmup():
    verdicts = feed(guard(), [3.0, math.nan, 3.0, 3.0], [1.0, 1.0, math.inf, 1.0])
    assert [v.reason for v in verdicts] == ["", "nonfinite", "nonfinite", ""]
    assert [e["signal"] for e in events(verdicts, EventName.INCIDENT_OPEN)] == ["nonfinite"]
    assert StepGuard(StabilityConfig(skip_nonfinite=False)).judge(math.nan, 1.0, 1, 100).apply


def test_no_z_verdict_during_warmup():
    losses, norms = noisy(60, 9, level=5.0), noisy(60, 10)
    losses[10] *= 100  # step 10 of a 30-step warm-up
    verdicts = feed(guard(), losses, norms)
    assert all(v.apply for v in verdicts)
    assert all(v.loss_z is None for v in verdicts[:WARMUP])
    assert verdicts[WARMUP + 20].loss_z is not None  # judged once 20 post-warm-up steps are in


def test_too_many_skips_in_a_row_halt_with_the_halt_exit_code():
    g = guard(max_consecutive_skips=3, rollback_after=2)
    assert not g.judge(math.nan, 1.0, 1, 0).rollback
    assert g.judge(math.nan, 1.0, 2, 0).rollback
    halting = g.judge(math.nan, 1.0, 3, 0)  # a skip like the others, recorded, then the halt
    assert not halting.apply and not halting.rollback
    assert re.search("3 steps in a row.*iteration 3", halting.halt)
    assert TrainingDivergedError(halting.halt).exit_code == HALT_EXIT_CODE == 3


def test_state_round_trip_continues_identically():
    losses, norms = noisy(120, 11, level=3.0), noisy(120, 12)
    g = guard()
    feed(g, losses[:100], norms[:100])
    g.judge(math.nan, 1.0, 101, 100)
    restored = guard()
    restored.load_state_dict(g.state_dict())
    assert restored.incident == g.incident and restored.consecutive_skips == 1
    assert feed(restored, losses[100:], norms[100:], 102, 100) == feed(g, losses[100:], norms[100:], 102, 100)


def rollback_record(iteration, target_step, extra, repeat=0):
    return SkipRange(0, 1, "rollback to step 0", LedgerKind.ROLLBACK, iteration,
                     {"target_step": target_step, "extra_batches": extra, "repeat": repeat})


def test_rollback_plan_goes_back_before_the_onset_and_further_on_a_repeat():
    cfg = StabilityConfig(rollback_lookback=10, skip_extra_batches=5, repeat_window=50, lr_backoff=0.5,
                          max_rollbacks=3)
    first = plan_rollback(cfg, [], onset_iter=120, onset_step=115, iteration=123)
    assert (first.max_target_step, first.extra_batches, first.lr_scale, first.repeat) == (105, 5, 0.5, 0)
    # A second incident 30 iterations after a rollback to step 100: one checkpoint further back,
    # twice the extra skip, the back-off squared.
    again = plan_rollback(cfg, [rollback_record(123, 100, 5)], onset_iter=153, onset_step=110, iteration=156)
    assert (again.max_target_step, again.extra_batches, again.lr_scale, again.repeat) == (99, 10, 0.25, 1)
    # Long after the last rollback: a fresh incident.
    later = plan_rollback(cfg, [rollback_record(123, 100, 5)], onset_iter=400, onset_step=350, iteration=403)
    assert (later.max_target_step, later.repeat) == (340, 0)
    with pytest.raises(TrainingDivergedError, match="after 3 rollbacks") as info:
        plan_rollback(cfg, [rollback_record(i, 50, 5) for i in (100, 200, 300)], 400, 350, 403)
    assert info.value.exit_code == HALT_EXIT_CODE


def test_lr_backoff_ramps_back_to_one():
    backoff = LRBackoff()
    assert backoff.factor(5) == 1.0
    backoff.start(step=100, scale=0.25, ramp_steps=10)
    assert [backoff.factor(s) for s in (100, 105, 110, 200)] == [0.25, 0.625, 1.0, 1.0]
    restored = LRBackoff()
    restored.load_state_dict(backoff.state_dict())
    assert restored.factor(105) == 0.625


# Guard v3: the warm-up and the router are judged too.

VOCAB = 8192  # the untrained model's loss: ln 8192 = 9.01


def v3_guard(**changes) -> StepGuard:
    return StepGuard(StabilityConfig(**changes), warmup_steps=WARMUP, vocab_size=VOCAB, first_moe_layer=1)


def test_a_warmup_loss_above_the_untrained_models_is_skipped_and_opens_an_incident():
    losses = [9.1, 9.0, 8.8, 9.8, 8.7]  # iteration 4: above ln V + 0.5, in the warm-up (no z-score)
    verdicts = feed(v3_guard(), losses, [1.0] * 5)
    assert [v.reason for v in verdicts] == ["", "", "", "loss_ceiling", ""]
    assert all(v.loss_z is None for v in verdicts)
    (opened,) = events(verdicts, EventName.INCIDENT_OPEN)
    assert (opened["iter"], opened["signal"], opened["z"]) == (4, "loss", None)
    assert all(v.apply for v in feed(v3_guard(loss_ceiling_margin=0), losses, [1.0] * 5))  # 0: off


def test_a_warmup_gradient_norm_jump_against_its_own_median_is_skipped():
    norms = [5.0, 3.0, 2.5, 2.0, 2.2, 30.0, 2.1]  # 30 is 12x the median (2.5) of the norms before it
    verdicts = feed(v3_guard(), [8.0] * len(norms), norms)
    assert [v.reason for v in verdicts] == [""] * 5 + ["grad_jump", ""]
    assert events(verdicts, EventName.INCIDENT_OPEN)[0]["signal"] == "grad_norm"
    # The first steps' norms are not judged (fewer than three before them), nor with the ratio 0.
    assert all(v.apply for v in feed(v3_guard(), [8.0] * 3, [1.0, 50.0, 60.0]))
    assert all(v.apply for v in feed(v3_guard(warmup_grad_ratio=0), [8.0] * len(norms), norms))


def judge_routing(g, rows_per_step):
    """Judge balanced loss and norm with the given tokens per expert, one [MoE layers, E] per step."""
    return [g.judge(3.0, 1.0, i + 1, i, torch.tensor(rows, dtype=torch.float64))
            for i, rows in enumerate(rows_per_step)]


def test_routing_collapse_over_m_steps_in_a_row_is_an_event_naming_the_layer():
    balanced = [[16, 16, 16, 16], [16, 16, 16, 16]]
    collapsed = [[16, 16, 16, 16], [58, 4, 2, 0]]  # MoE layer 1 = model layer 2: load 3.6, one dead
    g = v3_guard(routing_steps=3, calm_steps=2)
    steps = [collapsed] * 2 + [balanced] + [collapsed] * 5 + [balanced] * 2
    verdicts = judge_routing(g, steps)
    assert all(v.apply for v in verdicts)  # skipping does not mend a router
    (collapse,) = events(verdicts, EventName.ROUTING_COLLAPSE)  # once per episode, at its third step
    assert (collapse["iter"], collapse["layer"], collapse["dead_experts"]) == (6, 2, 1)
    assert collapse["max_load"] == pytest.approx(58 * 4 / 64)
    (opened,) = events(verdicts, EventName.INCIDENT_OPEN)
    assert (opened["iter"], opened["signal"]) == (6, "routing")
    (closed,) = events(verdicts, EventName.INCIDENT_CLOSE)  # open while it lasts, then calm_steps
    assert closed["iter"] == 10
    # Either threshold alone: a busy expert without a dead one, or a dead one without a busy one.
    assert events(judge_routing(v3_guard(routing_steps=1, routing_max_load=3.0), [[[52, 4, 4, 4]]]),
                  EventName.ROUTING_COLLAPSE)
    assert not events(judge_routing(v3_guard(routing_steps=1, routing_dead_experts=0, routing_max_load=0),
                                    [[[64, 0, 0, 0]]]), EventName.ROUTING_COLLAPSE)


def test_skips_that_do_not_end_the_incident_ask_for_a_rollback_even_between_applied_steps():
    # A spike comes from an update already applied: skips with normal steps between them (too few
    # to close the incident) did not bring the loss back.
    verdicts = feed(v3_guard(rollback_after=3), [9.0, 9.0, 10.0, 9.0, 10.0, 9.0, 10.0], [1.0] * 7)
    assert [v.reason for v in verdicts] == ["", "", "loss_ceiling", "", "loss_ceiling", "", "loss_ceiling"]
    assert [v.rollback for v in verdicts] == [False] * 6 + [True]
    assert verdicts[-1].onset_iter == 3


def test_a_divergence_from_step_0_asks_for_rollbacks_before_it_halts():
    # x100 learning rates: the loss is worse than the untrained model's from the second step on.
    g = v3_guard(rollback_after=3, max_consecutive_skips=10)
    losses = [9.1] + [11.0 + 0.05 * i for i in range(20)]
    verdicts = []
    for i, loss in enumerate(losses):
        verdicts.append(g.judge(loss, 1.0, i + 1, min(i, 1)))
        if verdicts[-1].halt:
            break
    assert re.search("10 steps in a row.*loss_ceiling", verdicts[-1].halt) and len(verdicts) == 11
    assert [v.rollback for v in verdicts[1:]] == [False, False] + [True] * 7 + [False]  # skips 3-9 ask first
    assert {v.onset_iter for v in verdicts[1:]} == {2}


def test_v3_state_round_trip_continues_identically():
    g = v3_guard(routing_steps=3)
    feed(g, [9.0] * 5, [3.0, 2.0, 2.5, 2.0, 2.2])
    judge_routing(g, [[[16, 16, 16, 16], [58, 4, 2, 0]]] * 2)
    restored = v3_guard(routing_steps=3)
    restored.load_state_dict(g.state_dict())
    assert list(restored.early.grad_norms) == list(g.early.grad_norms) and restored.routing.streaks == [0, 2]
    step = [[[16, 16, 16, 16], [58, 4, 2, 0]]]
    assert events(judge_routing(restored, step), EventName.ROUTING_COLLAPSE) == \
        events(judge_routing(g, step), EventName.ROUTING_COLLAPSE) != []
