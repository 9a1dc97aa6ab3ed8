"""The global sample order: which sequence of which source is training sample *s*.

Training reads one infinite stream of samples; global batch *i* is a contiguous run of it. Sample
*s* is located in O(1), with no state, from (seed, sources, weights, *s*):

1. Mixing. The stream is cut into blocks of `MIX_BLOCK` samples. Within the phase in force, each
   block holds exactly `quota[k]` samples of source k (the weights apportioned to the block), in
   a seeded shuffled arrangement. So the j-th sample of a block is source `layout[j]`, and it is
   that source's (samples of k before this phase + block * quota[k] + rank of j among k's slots)-th
   sample. Phases change the weights from a given sample on.
2. Ordering. A source's samples run through its sequences in epochs; each epoch is a fresh seeded
   permutation, so no sequence repeats before every other has been seen. `StatelessOrder`
   computes it per index (a few round keys, whatever the data's size): order version 2
   (`SAMPLE_ORDER`, recorded in the loader's state). Version 1, which materialised each
   permutation (8 bytes per sequence per rank: 29 GB at 15T tokens), was removed; a checkpoint
   in it is refused.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIX_BLOCK = 4096  # weight resolution is 1/MIX_BLOCK
_MIX_STREAM, _ORDER_STREAM = 0x6D6978, 0x6F7264  # separate the two uses of the seed
_CACHED = 8
_FEISTEL_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer quotas summing to `total`, proportional to `weights` (largest remainders)."""
    exact = weights / weights.sum() * total
    quota = np.floor(exact).astype(np.int64)
    shortfall = total - int(quota.sum())
    order = np.argsort(-(exact - quota), kind="stable")
    quota[order[:shortfall]] += 1
    return quota


class _LRU(OrderedDict):
    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > _CACHED:
            self.popitem(last=False)
        return value


class MixSchedule:
    """Maps stream sample indices to (source, index within that source's own stream)."""

    def __init__(self, phases: list[tuple[int, list[float]]], seed: int, block: int = MIX_BLOCK):
        """`phases`: (first sample, weight per source), the first starting at sample 0."""
        if not phases or phases[0][0] != 0:
            raise ValueError("the first phase must start at sample 0")
        self.seed, self.block = seed, block
        self.num_sources = len(phases[0][1])
        self.starts = np.array([s for s, _ in phases], dtype=np.int64)
        self.quotas = [apportion(np.asarray(w, dtype=np.float64), block) for _, w in phases]
        self._layouts = _LRU()
        # How many samples of each source the phases before phase p took.
        self._before = [np.zeros(self.num_sources, dtype=np.int64)]
        for p in range(len(phases) - 1):
            length = int(self.starts[p + 1] - self.starts[p])
            full, rest = divmod(length, block)
            labels, _ = self._layout(p, full)
            taken = full * self.quotas[p] + np.bincount(labels[:rest], minlength=self.num_sources)
            self._before.append(self._before[-1] + taken)

    def _layout(self, phase: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each slot of a block, and each slot's rank among its source's slots."""
        def make():
            quota = self.quotas[phase]
            rng = np.random.default_rng([self.seed, _MIX_STREAM, phase, block])
            labels = rng.permutation(np.repeat(np.arange(self.num_sources), quota))
            order = np.argsort(labels, kind="stable")
            ranks = np.empty(self.block, dtype=np.int64)
            ranks[order] = np.arange(self.block) - np.repeat(np.cumsum(quota) - quota, quota)
            return labels, ranks
        return self._layouts.get_or((phase, block), make)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        phase = np.searchsorted(self.starts, samples, side="right") - 1
        offset = samples - self.starts[phase]
        block, slot = np.divmod(offset, self.block)
        source = np.empty_like(samples)
        index = np.empty_like(samples)
        for p, b in set(zip(phase.tolist(), block.tolist())):
            sel = (phase == p) & (block == b)
            labels, ranks = self._layout(p, b)
            k = labels[slot[sel]]
            source[sel] = k
            index[sel] = self._before[p][k] + b * self.quotas[p][k] + ranks[slot[sel]]
        return source, index


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche of uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A seeded bijection of [0, n) computed per element: no table, O(1) memory.

    A balanced Feistel network over 2*h bits (4**h >= n, so at most 4n) is a permutation of
    [0, 4**h) whatever its round function; cycle-walking (apply it again while the result is >= n)
    restricts it to [0, n) and stays a bijection, at most 4 applications on average (4**h / n).
    The round function is splitmix64's finaliser of (half ^ round key), the six keys drawn from
    the seed (Luby-Rackoff: four rounds of a random function already give a pseudo-random
    permutation). Vectorised: a batch of indices is permuted at once.
    """

    def __init__(self, n: int, key: list[int]):
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(key).integers(0, 2**63, size=_FEISTEL_ROUNDS, dtype=np.uint64)

    def _once(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = np.asarray(indices, dtype=np.int64).astype(np.uint64)
        if x.size and (int(x.max()) >= self.n):
            raise IndexError(f"index {int(x.max())} outside [0, {self.n})")
        x = self._once(x)
        walking = np.flatnonzero(x >= np.uint64(self.n))
        while walking.size:
            x[walking] = self._once(x[walking])
            walking = walking[x[walking] >= np.uint64(self.n)]
        return x.astype(np.int64)


class StatelessOrder:
    """Order version 2: sample m of a source is sequence perm_e[m mod N], e = m // N, a fresh
    seeded permutation per epoch; perm_e is a `FeistelPermutation`, so a rank holds a few keys
    per cached epoch instead of N int64.

    Chosen over a two-level order (shuffle the shards, then the sequences inside each): that one
    is no cheaper (it still needs a bijection inside a shard of ~10^6 sequences), mixes worse (a
    run of consecutive samples comes from one shard) and ties the order to the shard layout, so a
    dataset re-sharded with the same tokens would train in another order.
    """

    def __init__(self, num_sequences: int, seed: int, source: int):
        self.num_sequences, self.seed, self.source = num_sequences, seed, source
        self._perms = _LRU()

    def _permutation(self, epoch: int) -> FeistelPermutation:
        return self._perms.get_or(epoch, lambda: FeistelPermutation(
            self.num_sequences, [self.seed, _ORDER_STREAM, self.source, epoch, 2]))

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        epoch, within = np.divmod(np.asarray(indices, dtype=np.int64), self.num_sequences)
        out = np.empty_like(within)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            out[sel] = self._permutation(e)(within[sel])
        return out


# The version of the sample order `StatelessOrder` computes, recorded in the loader's state (a
# state without it is version 1's).
SAMPLE_ORDER = 2
