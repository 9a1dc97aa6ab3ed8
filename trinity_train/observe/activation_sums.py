"""What one activation tensor contributes to the layer statistics, and how the summed
contributions of every micro-batch and rank become the statistics.

Everything a statistic needs is a sum or a maximum over elements, so it can be accumulated over
micro-batches and reduced over ranks exactly (and identically under every parallel layout):

- power sums accumulated in float64: n, sum(x), sum(x^2), sum(x^3), sum(x^4) -> RMS =
  sqrt(S2/n) and the excess kurtosis m4/m2^2 - 3 of the central moments (population form, 0 for
  a Gaussian);
- max |x| (exact);
- a histogram of |x| in fixed bins, from which the median of |x| is read.

The median is not a sum, so it is read from the histogram. Its bins are the float32 values of
|x| with all but 8 mantissa bits dropped (the bit pattern shifted right by 15: one integer
operation per element, no logarithm): 256 bins per octave from 2^-32 to 2^32, plus one bin below
(zeros included) and one above (inf and NaN too). The bin holding the lower median
(`torch.median`'s definition: the element of rank floor((n-1)/2)) is found exactly from the
counts, and the median is interpolated linearly inside it, so the estimate lies in the same bin
as the exact value, whose upper edge is at most 2^-8 above its lower one: within 0.39 % of it.
Counts are exact integers (float64), so every layout, whichever ranks held which elements, reads
the same bin.
"""

from __future__ import annotations

import math

import torch

LOG2_LOW, LOG2_HIGH = -32, 32  # the histogram's range of |x|: [2^LOG2_LOW, 2^LOG2_HIGH)
MANTISSA_BITS = 8  # of float32's 23, kept in a bin's key
BINS_PER_OCTAVE = 1 << MANTISSA_BITS
_KEY_SHIFT = 23 - MANTISSA_BITS
_FIRST_KEY = (127 + LOG2_LOW) << MANTISSA_BITS  # the key of 2^LOG2_LOW (biased exponent, mantissa)
RANGE_BINS = (LOG2_HIGH - LOG2_LOW) * BINS_PER_OCTAVE
HISTOGRAM_BINS = RANGE_BINS + 2  # plus one bin below 2^LOG2_LOW and one at or above 2^LOG2_HIGH
MEDIAN_RELATIVE_PRECISION = 2.0**-MANTISSA_BITS  # a bin's width over its lower edge, at most

NUM_POWER_SUMS = 5  # n, S1, S2, S3, S4


def _chunks(x: torch.Tensor):
    """The elements of x in pieces: small enough on a CPU that their float64 copies stay in cache
    (several times faster than one pass over a large copy), large on a GPU (few kernels)."""
    size = 1 << 16 if x.device.type == "cpu" else 1 << 24
    return x.detach().reshape(-1).split(size)


def power_sums(x: torch.Tensor) -> torch.Tensor:
    """[n, S1, S2, S3, S4] of the elements of x, float64."""
    parts = [torch.zeros(4, dtype=torch.float64, device=x.device)]
    for chunk in _chunks(x):
        c = chunk.double()
        c2 = c * c
        parts.append(torch.stack([c.sum(), c2.sum(), torch.dot(c2, c), torch.dot(c2, c2)]))
    total = torch.zeros(NUM_POWER_SUMS, dtype=torch.float64, device=x.device)
    total[0] += x.numel()
    total[1:] += torch.stack(parts).sum(dim=0)
    return total


def square_sums(x: torch.Tensor) -> torch.Tensor:
    """[n, S2] of the elements of x, float64."""
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    total[0] += x.numel()
    for chunk in _chunks(x):
        c = chunk.double()
        total[1] += torch.dot(c, c)
    return total


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float64 [1] (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=x.device)
    return x.detach().abs().amax().double().reshape(1)


def magnitude_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of |x| in the fixed bins (HISTOGRAM_BINS, float64)."""
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64, device=x.device)
    for chunk in _chunks(x):
        # For non-negative floats the bit pattern, read as an integer, orders like the value.
        key = (chunk.float().abs().view(torch.int32) >> _KEY_SHIFT) - (_FIRST_KEY - 1)
        key = key.clamp_(0, HISTOGRAM_BINS - 1).long()
        counts.index_add_(0, key, torch.ones(key.numel(), dtype=torch.float64, device=x.device))
    return counts


def bin_edges(b: int) -> tuple[float, float]:
    """[low, high) of the values in bin b (1 .. RANGE_BINS)."""
    def value(key: int) -> float:
        exponent, mantissa = divmod(key, BINS_PER_OCTAVE)
        return math.ldexp(1.0 + mantissa / BINS_PER_OCTAVE, exponent - 127)

    key = _FIRST_KEY + b - 1
    return value(key), value(key + 1)


def router_entropy_sums(scores: torch.Tensor) -> torch.Tensor:
    """[tokens, sum over tokens of the entropy (nats) of the scores normalised to sum 1], float64,
    from router scores [tokens, experts]."""
    s = scores.detach().double()
    p = s / s.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    total = torch.zeros(2, dtype=torch.float64, device=s.device)
    total[0] += s.shape[0]
    total[1] += entropy.sum()
    return total


# ---------------------------------------------------------------------------- reading the sums


def rms(count: float, square_sum: float) -> float | None:
    return math.sqrt(square_sum / count) if count > 0 else None


def excess_kurtosis(sums: list[float]) -> float | None:
    """m4 / m2^2 - 3 from [n, S1, S2, S3, S4] (central moments from the raw sums in float64)."""
    n, s1, s2, s3, s4 = sums
    if n <= 0:
        return None
    mean = s1 / n
    m2 = s2 / n - mean * mean
    m4 = s4 / n - 4 * mean * s3 / n + 6 * mean * mean * s2 / n - 3 * mean**4
    if m2 <= 0:
        return None
    return m4 / (m2 * m2) - 3.0


def histogram_median(counts: list[float]) -> float | None:
    """The median of |x| read from `magnitude_histogram` counts (summed over micro-batches and
    ranks): within MEDIAN_RELATIVE_PRECISION of `torch.median(x.abs())`. 0 when it lies below
    2^LOG2_LOW, None when it lies beyond 2^LOG2_HIGH (or is NaN) or there are no counts."""
    n = sum(counts)
    if n <= 0:
        return None
    rank = math.floor((n - 1) / 2)  # 0-based rank of the lower median
    before = 0.0
    for k, c in enumerate(counts):
        if before + c > rank:
            break
        before += c
    if k == 0:
        return 0.0
    if k == len(counts) - 1:
        return None
    low, high = bin_edges(k)
    inside = (rank - before + 0.5) / c  # where the median falls among the bin's elements
    return low + inside * (high - low)


def max_over_median(maximum: float, counts: list[float]) -> float | None:
    median = histogram_median(counts)
    if not median:
        return None
    return maximum / median
