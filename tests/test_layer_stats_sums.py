"""The sums behind the layer statistics (observe/activation_sums.py): the median read from the
histogram of |x| is within its stated precision of torch.median on hard cases, splitting the
elements across micro-batches or ranks changes nothing, and the kurtosis from raw float64 sums
matches the direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_train.observe import activation_sums as sums

# The estimate lies in the bin of the exact median, which is at most this much wider than its
# lower edge.
BOUND = sums.MEDIAN_RELATIVE_PRECISION


def median_estimate(*parts: torch.Tensor) -> float | None:
    return sums.histogram_median(sum(sums.magnitude_histogram(p) for p in parts).tolist())


def cases():
    gen = torch.Generator().manual_seed(0)
    yield "gaussian", torch.randn(10001, generator=gen)
    yield "even count", torch.randn(4096, generator=gen) * 3
    yield "log-normal over 40 octaves", torch.exp(torch.randn(20000, generator=gen) * 9)
    yield "massive outliers", torch.cat([torch.randn(5000, generator=gen), torch.full((20,), 1e6)])
    yield "mostly zeros but a nonzero median", torch.cat([torch.zeros(400), torch.rand(600, generator=gen) + 0.5])
    yield "three values", torch.tensor([0.1, -5.0, 1e3])
    # every value on or one ulp either side of a bin edge, over 8 octaves
    edges = torch.tensor([sums.bin_edges(b)[0] for b in range(7000, 9048)], dtype=torch.float32)
    yield "bin edges", torch.cat([edges, torch.nextafter(edges, torch.zeros(1)), torch.nextafter(edges, edges * 2)])
    yield "powers of two", -(2.0 ** torch.arange(-30, 31, dtype=torch.float32))
    yield "bf16 activations", (torch.randn(8192, generator=gen) * 40).bfloat16()


@pytest.mark.parametrize("name, x", list(cases()), ids=[n for n, _ in cases()])
def test_histogram_median_is_within_one_bin_of_the_exact_median(name, x):
    exact = x.abs().median().double().item()
    estimate = median_estimate(x)
    assert abs(estimate / exact - 1) < BOUND, (estimate, exact)


def test_any_split_of_the_elements_gives_the_same_counts_and_sums():
    x = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    whole = (sums.power_sums(x), sums.magnitude_histogram(x), sums.abs_max(x))
    parts = x.split([1, 2]) + x.split(16, dim=1)  # micro-batches, then sequence shards of them
    for pieces in (parts[:2], parts[2:]):
        assert torch.equal(sum(sums.magnitude_histogram(p) for p in pieces), whole[1])
        torch.testing.assert_close(sum(sums.power_sums(p) for p in pieces), whole[0], rtol=1e-12, atol=1e-9)
        assert torch.equal(torch.stack([sums.abs_max(p) for p in pieces]).max(), whole[2].max())


def test_bins_are_contiguous_and_at_most_the_stated_precision_wide():
    edges = [sums.bin_edges(b) for b in range(1, sums.RANGE_BINS + 1)]
    assert edges[0][0] == 2.0**sums.LOG2_LOW and edges[-1][1] == 2.0**sums.LOG2_HIGH
    assert all(high == next_low for (_, high), (next_low, _) in zip(edges, edges[1:]))
    assert max(high / low - 1 for low, high in edges) == sums.MEDIAN_RELATIVE_PRECISION
    counts = sums.magnitude_histogram(torch.tensor([edges[100][0], edges[100][1] * (1 - 2**-20), 0.0, math.inf]))
    assert counts[101].item() == 2 and counts[0].item() == 1 and counts[-1].item() == 1


def test_median_edge_cases():
    assert median_estimate(torch.zeros(10)) == 0.0  # below the range: zero
    assert median_estimate(torch.full((3,), 2.0**40)) is None  # beyond the range: unknown
    assert sums.histogram_median([0.0] * sums.HISTOGRAM_BINS) is None
    assert sums.max_over_median(1.0, sums.magnitude_histogram(torch.zeros(4)).tolist()) is None


def test_kurtosis_from_raw_sums_matches_the_direct_computation():
    gen = torch.Generator().manual_seed(2)
    for x in (torch.randn(50000, generator=gen) + 3.0,  # a mean far from 0: the sums must cancel it
              torch.distributions.Laplace(0.0, 1.0).sample((50000,)),
              torch.rand(50000, generator=gen)):
        d = x.double()
        c = d - d.mean()
        direct = (c.pow(4).mean() / c.square().mean().square()).item() - 3.0
        assert sums.excess_kurtosis(sums.power_sums(x).tolist()) == pytest.approx(direct, abs=1e-9)
        assert sums.rms(*sums.square_sums(x).tolist()) == pytest.approx(d.square().mean().sqrt().item())
    assert sums.excess_kurtosis(sums.power_sums(torch.ones(5)).tolist()) is None  # no spread
    assert sums.excess_kurtosis([0.0] * 5) is None


def test_router_entropy_of_uniform_and_one_hot_scores():
    uniform = torch.full((3, 8), 0.4)
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 5]), 8).float()
    assert sums.router_entropy_sums(uniform).tolist() == pytest.approx([3, 3 * math.log(8)])
    assert sums.router_entropy_sums(one_hot).tolist() == [2.0, 0.0]
