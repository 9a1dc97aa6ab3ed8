"""Fewer points for a chart without hiding a spike.

A chart `width` pixels wide cannot show more than about one value per pixel column, so a long
series is cut into `width` buckets of consecutive points and each bucket keeps its smallest and
its largest value (in their order along x). Averaging, or keeping every k-th point, would make a
one-step loss spike vanish; the min/max of its bucket always keeps it. Missing values (NaN) are
ignored as values, but the first NaN after each value is kept (up to `width` of them), since the
chart draws it as a gap: the break of a line at a rollback survives downsampling.
"""

from __future__ import annotations

import numpy as np


def window(x: np.ndarray, x0: float | None, x1: float | None) -> slice:
    """The points of the sorted `x` within [x0, x1], plus one neighbour on each side so that a
    zoomed line runs to the edges of the plot."""
    lo = 0 if x0 is None else max(int(np.searchsorted(x, x0, "left")) - 1, 0)
    hi = len(x) if x1 is None else min(int(np.searchsorted(x, x1, "right")) + 1, len(x))
    return slice(lo, max(lo, hi))


def minmax_indices(y: np.ndarray, width: int) -> np.ndarray:
    """Indices into `y` (ascending) of at most 3 * `width` points that keep every bucket's
    extremes and the line's breaks; all indices when `y` is short already."""
    n = len(y)
    if n <= 2 * width:
        return np.arange(n)
    size = -(-n // width)  # points per bucket
    buckets = -(-n // size)
    padded = np.full(buckets * size, np.nan, np.float64)
    padded[:n] = y
    grid = padded.reshape(buckets, size)
    missing = np.isnan(grid)
    lowest = np.where(missing, np.inf, grid).argmin(axis=1)
    highest = np.where(missing, -np.inf, grid).argmax(axis=1)
    empty = missing.all(axis=1)
    lowest[empty] = highest[empty] = 0
    base = np.arange(buckets) * size
    picked = np.unique(np.concatenate([base + lowest, base + highest]))
    picked = picked[picked < n]
    nan = np.isnan(np.asarray(y, np.float64))
    gaps = np.flatnonzero(nan[1:] & ~nan[:-1]) + 1  # where a line breaks
    return np.union1d(picked, gaps) if len(gaps) <= width else picked


def bucket_max(x: np.ndarray, z: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """For a heatmap over x (rows of `z` [n, k] along x): at most `width` columns, each the
    largest value of its bucket per row (a load spike is not averaged away) at the bucket's
    first x."""
    n = len(x)
    if n <= width:
        return x, z
    size = -(-n // width)
    starts = np.arange(0, n, size)
    with np.errstate(invalid="ignore"):
        filled = np.where(np.isnan(z), -np.inf, z)
        peaks = np.maximum.reduceat(filled, starts, axis=0)
    peaks[np.isneginf(peaks)] = np.nan
    return x[starts], peaks
