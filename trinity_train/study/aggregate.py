"""The headline values of each cell and their mean ± std over the seeds of a (variant, LR) group.

A group's mean leaves out drilled cells (a drill is a rehearsal, not a measurement) and values a
cell did not record (a diverged cell has no final validation loss); its stability counts do
include diverged cells, which are the point of the aggressive learning rate.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable


def _at(path: tuple) -> Callable[[dict], float | None]:
    def get(measures: dict) -> float | None:
        value = measures
        for key in path:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None
    return get


@dataclass(frozen=True)
class Headline:
    key: str  # in summary.json
    header: str  # in the tables
    get: Callable[[dict], float | None]  # from a cell's measures
    fmt: str  # format of one value


STABILITY = (
    Headline("val_loss_50", "val loss @50%", _at(("val_loss_at", "50%", "val_loss")), "{:.3f}"),
    Headline("val_loss_100", "val loss @100%", _at(("val_loss_at", "100%", "val_loss")), "{:.3f}"),
    Headline("skipped_steps", "skipped", _at(("skipped_steps",)), "{:.1f}"),
    Headline("rollbacks", "rollbacks", _at(("rollbacks",)), "{:.1f}"),
    Headline("nonfinite_steps", "non-finite", _at(("nonfinite_steps",)), "{:.1f}"),
    Headline("observed_spikes", "spikes (observed)", _at(("observed_spikes",)), "{:.1f}"),
    Headline("observed_rollbacks", "would-be rollbacks", _at(("observed_rollbacks",)), "{:.1f}"),
    Headline("clipped_fraction", "clipped", _at(("clipped_fraction",)), "{:.0%}"),
    Headline("max_grad_norm", "max grad norm", _at(("max_grad_norm",)), "{:.3g}"),
)
DEPTH = (
    Headline("grad_spread_10", "grad max/min @10%", _at(("layers", "10%", "spread")), "{:.2f}"),
    Headline("grad_spread_100", "grad max/min @100%", _at(("layers", "100%", "spread")), "{:.2f}"),
    Headline("grad_log_slope_100", "grad ln-slope @100%", _at(("layers", "100%", "log_slope")), "{:+.3f}"),
    Headline("residual_first_100", "residual RMS after block 0", _at(("layers", "100%", "residual_first")), "{:.3g}"),
    Headline("residual_last_100", "residual RMS after last block", _at(("layers", "100%", "residual_last")), "{:.3g}"),
    Headline("residual_ratio_100", "residual RMS last/first", _at(("layers", "100%", "residual_ratio")), "{:.2f}"),
    Headline("max_kurtosis_100", "max kurtosis", _at(("layers", "100%", "max_kurtosis")), "{:.1f}"),
    Headline("max_over_median_100", "max |a|/median", _at(("layers", "100%", "max_over_median")), "{:.1f}"),
    Headline("moe_max_load", "MoE max load", _at(("moe_max_load",)), "{:.2f}"),
    Headline("tokens_per_s", "tokens/s", _at(("tokens_per_s",)), "{:.0f}"),
)
HEADLINES = STABILITY + DEPTH


def headline_values(measures: dict | None) -> dict[str, float | None]:
    return {h.key: h.get(measures) if measures else None for h in HEADLINES}


def mean_std(values: list[float]) -> dict:
    """{"mean", "std" (sample; None for one value), "n"}."""
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}


def status_counts(cells: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    return counts


def groups(cells: list[dict]) -> list[dict]:
    """One entry per (variant, LR setting), in the cells' order: its seeds, outcome counts and the
    mean ± std of every headline over its measured (not drilled) cells."""
    order: dict[tuple[str, str], list[dict]] = {}
    for cell in cells:
        order.setdefault((cell["variant"], cell["lr"]), []).append(cell)
    out = []
    for (variant, lr), members in order.items():
        measured = [c for c in members if not c["drilled"]]
        out.append({"variant": variant, "lr": lr, "seeds": [c["seed"] for c in members],
                    "status": status_counts(members), "drilled": len(members) - len(measured),
                    "values": {h.key: mean_std([v for c in measured if (v := c["headline"][h.key]) is not None])
                               for h in HEADLINES}})
    return out

