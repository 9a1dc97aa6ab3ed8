"""How far above its recent course a training signal is: a robust, one-sided z-score.

Each signal (the step's global loss, its global pre-clip gradient norm) is judged on the log of
its value against a rolling window of recent normal values. The window's course is a robust
straight line through (iteration, log value): the Theil-Sen fit (the median of all pairwise
slopes, then the median intercept) over optimizer steps, so a loss that is still falling fast or a gradient norm that
creeps up is not mistaken for noise or for a spike. The z-score is the new value's distance above
that line, extrapolated to its iteration, in units of the residuals' median absolute deviation
(times 1.4826, so it estimates sigma for normal noise). Logs make the statistic relative (2.0 ->
2.2 counts like 4.0 -> 4.4) and tame the heavy right tail of gradient norms; medians ignore the
outliers a window holds. A floor on sigma (`sigma_floor`, in log units) keeps a very smooth stretch
of training from making a tiny wobble look like a spike. Only values the caller calls normal enter
the window, so a spike does not widen the band that judges the next one.
"""

from __future__ import annotations

import functools
import math
from collections import deque

import numpy as np

MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 * MAD for normally distributed values


@functools.lru_cache(maxsize=16)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line through the points."""
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    apart = dx != 0  # a rollback can give two points the same step
    slope = float(np.median((y[j] - y[i])[apart] / dx[apart])) if apart.any() else 0.0
    return slope, float(np.median(y - slope * x))


class RollingSignal:
    """The recent normal values of one positive signal, and the z-score of a new value."""

    def __init__(self, window: int, min_history: int, sigma_floor: float):
        self.min_history = min_history
        self.sigma_floor = sigma_floor
        # (optimizer steps applied before it, log value): steps, not iterations, so the course
        # continues where a rollback restored it.
        self.points: deque[tuple[int, float]] = deque(maxlen=window)

    def zscore(self, value: float, step: int) -> float | None:
        """How many sigma log(value) lies above the window's course at `step`; None before
        `min_history` values, or for a value that is not positive and finite (the caller judges
        those)."""
        if len(self.points) < self.min_history or not (math.isfinite(value) and value > 0):
            return None
        x, y = (np.array(v, dtype=np.float64) for v in zip(*self.points))
        slope, intercept = theil_sen(x, y)
        residuals = y - (intercept + slope * x)
        sigma = max(MAD_TO_SIGMA * float(np.median(np.abs(residuals - np.median(residuals)))), self.sigma_floor)
        return (math.log(value) - (intercept + slope * step)) / sigma

    def add(self, value: float, step: int) -> None:
        if math.isfinite(value) and value > 0:
            self.points.append((step, math.log(value)))

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self.points]}

    def load_state_dict(self, state: dict) -> None:
        self.points = deque((tuple(p) for p in state["points"]), maxlen=self.points.maxlen)
