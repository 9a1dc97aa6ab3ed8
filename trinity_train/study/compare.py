"""Seed-paired comparisons: is a difference between two groups of cells larger than the noise?

The cells of one seed share their initialisation seed and (with `data_order = "seed"`) their data
order, so two groups are compared seed by seed: the differences d_s = a_s - b_s over the seeds
both measured, their mean, a 95 % Student-t interval (mean ± t(0.975, n-1) x sd/sqrt(n)) and the
two-sided p-value of the paired t-test. A difference is *within noise* when its interval holds 0
(p >= 0.05); with three seeds the interval is wide (t = 4.30), which is the point: a ranking the
interval does not support is not stated as one.

Compared (`COMPARED`): within each learning-rate setting every pair of variants, and within each
variant every pair of learning-rate settings (its sensitivity to the rate). Student's t is
computed here (the regularised incomplete beta function), not imported: the study needs no SciPy.
"""

from __future__ import annotations

import itertools
import math
import statistics

COMPARED = ("val_loss_100", "residual_last_100")  # headline keys (aggregate.HEADLINES)
LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = `level` (bisection on the p-value)."""
    low, high = 0.0, 1e6
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_two_sided_p(mid, df) > 1.0 - level:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """The seed-paired difference a - b: `n`, `seeds`, `mean`, `low`, `high` (the 95 % interval),
    `p`, `within_noise` (the interval holds 0; None with fewer than two seeds)."""
    seeds = sorted(s for s in set(a) & set(b) if _finite(a[s]) and _finite(b[s]))
    diffs = [a[s] - b[s] for s in seeds]
    out = {"n": len(diffs), "seeds": seeds, "mean": statistics.fmean(diffs) if diffs else None,
           "low": None, "high": None, "p": None, "within_noise": None}
    if len(diffs) < 2:
        return out
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    if se == 0.0:
        out.update(low=out["mean"], high=out["mean"], p=1.0 if out["mean"] == 0 else 0.0,
                   within_noise=out["mean"] == 0)
        return out
    half = t_quantile(LEVEL, len(diffs) - 1) * se
    out.update(low=out["mean"] - half, high=out["mean"] + half, p=t_two_sided_p(out["mean"] / se, len(diffs) - 1))
    out["within_noise"] = out["low"] <= 0.0 <= out["high"]
    return out


def _by_seed(cells: list[dict], key: str, variant: str, lr: str) -> dict[int, float]:
    return {c["seed"]: c["headline"][key] for c in cells
            if c["variant"] == variant and c["lr"] == lr and not c["drilled"] and _finite(c["headline"].get(key))}


def comparisons(cells: list[dict], variants: list[str], lrs: list[str]) -> list[dict]:
    """Every comparison of the report, each {"metric", "kind" ("variants" at one LR, or "lrs" of one
    variant), "lr" or "variant", "a", "b", and `paired(a, b)`'s fields}."""
    out = []
    for key in COMPARED:
        for lr in lrs:
            for a, b in itertools.combinations(variants, 2):
                result = paired(_by_seed(cells, key, a, lr), _by_seed(cells, key, b, lr))
                if result["n"]:
                    out.append({"metric": key, "kind": "variants", "lr": lr, "a": a, "b": b, **result})
        for variant in variants:
            for a, b in itertools.combinations(lrs, 2):
                result = paired(_by_seed(cells, key, variant, a), _by_seed(cells, key, variant, b))
                if result["n"]:
                    out.append({"metric": key, "kind": "lrs", "variant": variant, "a": a, "b": b, **result})
    return out
