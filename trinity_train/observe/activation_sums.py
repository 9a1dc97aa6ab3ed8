"""What one activation tensor contributes to the layer statistics, and how the summed
contributions of every micro-batch and rank become the statistics.

Everything a statistic needs is a sum or a maximum over elements, so it can be accumulated over
micro-batches and reduced over ranks exactly (and identically under every parallel layout):

- power sums in float64: n, sum(x), sum(x^2), sum(x^3), sum(x^4) -> RMS = sqrt(S2/n) and the
  excess kurtosis m4/m2^2 - 3 of the central moments (population form, 0 for a Gaussian);
- max |x| (exact);
- a histogram of log2|x| in fixed bins, from which the median of |x| is read.

The median is not a sum, so it is read from the histogram: 128 bins per octave from 2^-32 to
2^32, plus one bin below (zeros included) and one above. The bin that holds the lower median
(`torch.median`'s definition: the element of rank floor((n-1)/2)) is found exactly from the
counts, and the median is interpolated log-linearly inside it, so the estimate lies in the same
bin as the exact value: within a factor 2^(1/128) (0.55 %) of it. Counts are exact (float64
integers), so every layout, whichever ranks held which elements, reads the same bin.
"""

from __future__ import annotations

import math

import torch

LOG2_LOW, LOG2_HIGH = -32, 32  # the histogram's range of log2|x|
BINS_PER_OCTAVE = 128
BIN_WIDTH = 1.0 / BINS_PER_OCTAVE  # in log2 units: the median's precision bound is 2^BIN_WIDTH
RANGE_BINS = (LOG2_HIGH - LOG2_LOW) * BINS_PER_OCTAVE
HISTOGRAM_BINS = RANGE_BINS + 2  # plus one bin below 2^LOG2_LOW and one at or above 2^LOG2_HIGH
MEDIAN_RELATIVE_PRECISION = 2.0**BIN_WIDTH - 1.0

NUM_POWER_SUMS = 5  # n, S1, S2, S3, S4
# Elements converted to float64 at a time: bounds the temporary memory of a large activation.
CHUNK_ELEMENTS = 1 << 22


def _chunks(x: torch.Tensor):
    return x.detach().reshape(-1).split(CHUNK_ELEMENTS)


def power_sums(x: torch.Tensor) -> torch.Tensor:
    """[n, S1, S2, S3, S4] of the elements of x, float64."""
    total = torch.zeros(NUM_POWER_SUMS, dtype=torch.float64, device=x.device)
    for chunk in _chunks(x):
        c = chunk.double()
        c2 = c * c
        total[1:] += torch.stack([c.sum(), c2.sum(), (c2 * c).sum(), (c2 * c2).sum()])
    total[0] += x.numel()
    return total


def square_sums(x: torch.Tensor) -> torch.Tensor:
    """[n, S2] of the elements of x, float64."""
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    for chunk in _chunks(x):
        c = chunk.double()
        total[1] += (c * c).sum()
    total[0] += x.numel()
    return total


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float64 [1] (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=x.device)
    return x.detach().abs().amax().double().reshape(1)


def log2_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of log2|x| in the fixed bins (HISTOGRAM_BINS, float64)."""
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64, device=x.device)
    # Values outside the range are clamped to the middle of the bin just outside it: bin 0 holds
    # everything below 2^LOG2_LOW (zeros too), the last bin everything from 2^LOG2_HIGH up.
    low, high = LOG2_LOW - BIN_WIDTH, LOG2_HIGH + BIN_WIDTH
    for chunk in _chunks(x):
        logs = torch.log2(chunk.float().abs()).clamp_(low + BIN_WIDTH / 2, high - BIN_WIDTH / 2)
        counts += torch.histc(logs, bins=HISTOGRAM_BINS, min=low, max=high).double()
    return counts


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
    """The median of |x| read from `log2_histogram` counts (summed over micro-batches and ranks):
    within a factor 2^BIN_WIDTH of `torch.median(x.abs())`. 0 when it lies below 2^LOG2_LOW, None
    when it lies beyond 2^LOG2_HIGH or there are no counts."""
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
    inside = (rank - before + 0.5) / c  # where the median falls among the bin's elements
    return 2.0 ** (LOG2_LOW + (k - 1 + inside) * BIN_WIDTH)


def max_over_median(maximum: float, counts: list[float]) -> float | None:
    median = histogram_median(counts)
    if not median:
        return None
    return maximum / median
