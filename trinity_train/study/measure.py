"""What one cell measured, from its run directory alone (docs/CONTRACT.md "Run directory").

Loss and stability, from the `train`, `val` records and the events:
- `val`: the validation curve of the run's main line (`step`, `tokens` seen, `val_loss`), and
  `val_loss_at`: the loss at exactly 50 % and 100 % of the steps (None where no validation ran at
  that step: `eval.every` must divide it), so cells compare at matched token counts (every
  cell trains the same tokens per step);
- `skipped_steps`, `nonfinite_steps` (loss or gradient norm not finite), `rollbacks` (from the
  train records and the rollback events; a halt after too many skips in a row leaves its last
  step without a train record, the `halt` event says why);
- `observed_spikes`, `observed_rollbacks`: with the guard in observe mode (`stability.mode`), the
  steps it would have refused (its `guard_observed` events) and the incidents in which it would
  have rolled back or halted: spikes counted without a recovery changing what follows (None
  when the guard acted);
- `max_loss_jump` (and `max_loss_jump_batch`, the batch it came on): the largest rise of the train
  loss from one iteration to the next;
- `clipped_fraction`: applied steps whose pre-clip gradient norm exceeded `train.grad_clip`;
- `max_grad_norm`; `tokens_per_s` (median, past the first iterations); `moe_max_load` (the worst
  layer's busiest expert over the mean, averaged over the second half of training).

Depth profile, from the `layers` records (`metrics.layer_stats_every`), at 10, 50 and 100 % of
the steps: per layer the gradient norm (attention, FFN, and both together) with its spread across
depth (`spread`: max/min over layers; `log_slope`: least-squares slope of ln(norm) against the
layer index: negative when early layers get the larger gradients), the residual-stream RMS after
each block (absolute: `residual_first`, `residual_last`, after block 0 and after the last;
`residual_ratio`: last over first), the learned post-norm gains, and each block
output's excess kurtosis and max|a|/median|a|. Records of skipped steps are left out: a spike's
gradients are not the profile of the training.

Iterations a rollback undid (to_iter+1 .. iter) are left out of the main line (the validation
curve and the depth profile), as the dashboard fades them; the stability counts include them:
they are what happened.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from trinity_train.config import Config
from trinity_train.files import json_safe
from trinity_train.records import EventName, RecordKind, named
from trinity_train.rundir import RunDir

LAYER_POINTS = {"10%": 0.1, "50%": 0.5, "100%": 1.0}
VAL_POINTS = {"50%": 0.5, "100%": 1.0}
WARMUP_ITERS = 5  # the first iterations' throughput (allocation, first-touch) is not the run's
CURVE_POINTS = 200  # the train-loss curve kept for the plots
CURVE_SMOOTHING = 0.9  # its exponential moving average


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rollback_ranges(events: list[dict]) -> list[tuple[int, int]]:
    """Inclusive iteration ranges that rollbacks undid."""
    return sorted((e["to_iter"] + 1, e["iter"]) for e in named(events, EventName.ROLLBACK)
                  if isinstance(e.get("to_iter"), int) and isinstance(e.get("iter"), int))


def _main_line(records: list[dict], ranges: list[tuple[int, int]]) -> list[dict]:
    return [r for r in records if not any(a <= r.get("iter", -1) <= b for a, b in ranges)]


def log_slope(values: list[float]) -> float | None:
    """Least-squares slope of ln(value) against the index (None with fewer than two positive values)."""
    points = [(i, math.log(v)) for i, v in enumerate(values) if _finite(v) and v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def spread(values: list[float]) -> float | None:
    """max/min of the positive finite values."""
    kept = [v for v in values if _finite(v) and v > 0]
    return max(kept) / min(kept) if len(kept) >= 2 else None


def _ratio_last_first(values: list[float] | None) -> float | None:
    if not values or not (_finite(values[0]) and _finite(values[-1])) or values[0] <= 0:
        return None
    return values[-1] / values[0]


def _max_of(values: list | None) -> float | None:
    kept = [v for v in (values or []) if _finite(v)]
    return max(kept) if kept else None


def _record_near(records: list[dict], target_step: float, tolerance: float) -> dict | None:
    """The latest record at or before `target_step`, if it is within `tolerance` steps of it."""
    before = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= target_step + 1e-9]
    if not before:
        return None
    record = max(before, key=lambda r: (r["step"], r.get("iter") or 0))
    return record if target_step - record["step"] <= tolerance else None


def _depth_profile(record: dict) -> dict:
    attn, ffn = record.get("grad_norm_attn") or [], record.get("grad_norm_ffn") or []
    both = [math.hypot(a, f) if _finite(a) and _finite(f) else None for a, f in zip(attn, ffn)]
    gains = record.get("norm_gain") or {}
    residual = record.get("residual_rms")
    return {
        "step": record["step"], "iter": record["iter"],
        "grad_norm_attn": attn, "grad_norm_ffn": ffn, "grad_norm": both,
        "spread": spread(both), "log_slope": log_slope(both),
        "spread_attn": spread(attn), "spread_ffn": spread(ffn),
        "residual_rms": residual, "residual_ratio": _ratio_last_first(residual),
        "residual_first": residual[0] if residual and _finite(residual[0]) else None,
        "residual_last": residual[-1] if residual and _finite(residual[-1]) else None,
        "post_norm_gain": {"attn": gains.get("attn_post_norm"), "ffn": gains.get("mlp_post_norm")},
        "act_kurtosis": record.get("act_kurtosis"), "act_max_over_median": record.get("act_max_over_median"),
        "max_kurtosis": _max_of(record.get("act_kurtosis")),
        "max_over_median": _max_of(record.get("act_max_over_median")),
    }


def _loss_jump(train: list[dict]) -> tuple[float | None, int | None]:
    """The largest rise of the train loss from one iteration to the next, and the batch it came on."""
    ordered = sorted(train, key=lambda r: r["iter"])
    jumps = [(b.get("loss") - a.get("loss"), b.get("batch")) for a, b in zip(ordered, ordered[1:])
             if _finite(a.get("loss")) and _finite(b.get("loss"))]
    if not jumps:
        return None, None
    jump, batch = max(jumps, key=lambda j: j[0])
    return (jump, batch) if jump > 0 else (0.0, None)


def _observed(events: list[dict]) -> tuple[int, int]:
    """(steps the observing guard would have refused, incidents it would have rolled back or halted)."""
    seen = named(events, EventName.GUARD_OBSERVED)
    return len(seen), len({e.get("onset_iter") for e in seen if e.get("action") in ("rollback", "halt")})


def _val_curve(val: list[dict], tokens_at: dict[int, int]) -> list[dict]:
    curve = {}
    for r in val:
        if _finite(r.get("val_loss")) and isinstance(r.get("step"), int):
            curve[r["step"]] = {"step": r["step"], "iter": r.get("iter"), "tokens": tokens_at.get(r.get("iter"), 0 if r["step"] == 0 else None),
                                "val_loss": r["val_loss"]}
    return [curve[s] for s in sorted(curve)]


def _train_curve(main_train: list[dict]) -> dict:
    """The main line's train loss (exponential moving average) against the tokens seen, at most
    CURVE_POINTS points."""
    tokens, losses, average = [], [], None
    for r in main_train:
        if r.get("skipped") or not _finite(r.get("loss")) or not _finite(r.get("tokens_seen")):
            continue
        average = r["loss"] if average is None else CURVE_SMOOTHING * average + (1 - CURVE_SMOOTHING) * r["loss"]
        tokens.append(r["tokens_seen"])
        losses.append(average)
    keep = sorted({round(i * (len(tokens) - 1) / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)}) if tokens else []
    return {"tokens": [tokens[i] for i in keep], "loss": [losses[i] for i in keep]}


def measure_cell(run: RunDir, cfg: Config) -> dict:
    """Every measurement of one cell (module doc); None where the run did not record it."""
    steps = cfg.train.steps
    events = run.read_events()
    records = run.read_metrics()
    ranges = rollback_ranges(events)
    train = [r for r in records if r.get("kind") == RecordKind.TRAIN and isinstance(r.get("iter"), int)]
    main_train = _main_line(train, ranges)
    applied = [r for r in train if not r.get("skipped")]
    grad_norms = [r.get("grad_norm") for r in train]

    tokens_at = {r["iter"]: r.get("tokens_seen") for r in main_train}
    curve = _val_curve(_main_line([r for r in records if r.get("kind") == RecordKind.VAL], ranges), tokens_at)
    val_at = {}
    for label, fraction in VAL_POINTS.items():
        val_at[label] = next((p for p in curve if p["step"] == round(fraction * steps)), None)

    skipped = {r["iter"] for r in train if r.get("skipped")}  # a spike's gradients are no depth profile
    layers = sorted(_main_line([r for r in records if r.get("kind") == RecordKind.LAYERS and isinstance(r.get("iter"), int)
                                and r["iter"] not in skipped], ranges), key=lambda r: r["iter"])
    profile = {}
    for label, fraction in LAYER_POINTS.items():
        record = _record_near(layers, fraction * steps, tolerance=0.1 * steps)
        profile[label] = _depth_profile(record) if record else None

    clip = cfg.train.grad_clip
    clip_norms = [r.get("grad_norm") for r in applied if _finite(r.get("grad_norm"))]
    throughput = [r["tokens_per_s"] for r in main_train if r["iter"] > WARMUP_ITERS and not r.get("skipped")
                  and _finite(r.get("tokens_per_s"))]
    second_half = [r["moe_max_load"] for r in main_train if not r.get("skipped") and _finite(r.get("moe_max_load"))
                   and isinstance(r.get("step"), int) and r["step"] > steps / 2]
    jump, jump_batch = _loss_jump(train)
    observed_spikes, observed_rollbacks = _observed(events) if cfg.stability.mode == "observe" else (None, None)
    return json_safe({
        "steps": steps,
        "last_step": max((r["step"] for r in train if isinstance(r.get("step"), int)), default=0),
        "val": curve,
        "train_curve": _train_curve(main_train),
        "val_loss_at": val_at,
        "skipped_steps": sum(1 for r in train if r.get("skipped")),
        "nonfinite_steps": sum(1 for r in train if not (_finite(r.get("loss")) and _finite(r.get("grad_norm")))),
        "rollbacks": len(named(events, EventName.ROLLBACK)),
        "halt": next(({k: e.get(k) for k in ("iter", "step", "reason")}
                      for e in reversed(named(events, EventName.HALT))), None),
        "observed_spikes": observed_spikes,
        "observed_rollbacks": observed_rollbacks,
        "max_loss_jump": jump,
        "max_loss_jump_batch": jump_batch,
        "clipped_fraction": (sum(1 for g in clip_norms if g > clip) / len(clip_norms)) if clip > 0 and clip_norms else None,
        "max_grad_norm": _max_of(grad_norms),
        "tokens_per_s": statistics.median(throughput) if throughput else None,
        "moe_max_load": statistics.fmean(second_half) if second_half else None,
        "layers": profile,
        "peak_kurtosis": _max_of([_max_of(r.get("act_kurtosis")) for r in layers]),
        "peak_max_over_median": _max_of([_max_of(r.get("act_max_over_median")) for r in layers]),
    })
