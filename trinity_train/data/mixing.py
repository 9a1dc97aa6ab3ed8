"""The global sample order: which sequence of which source is training sample *s*.

Training reads one infinite stream of samples; global batch *i* is a contiguous run of it. Sample
*s* is located in O(1), with no state, from (seed, sources, weights, *s*):

1. Mixing. The stream is cut into blocks of `MIX_BLOCK` samples. Within the phase in force, each
   block holds exactly `quota[k]` samples of source k (the weights apportioned to the block), in
   a seeded shuffled arrangement. So the j-th sample of a block is source `layout[j]`, and it is
   that source's (samples of k before this phase + block * quota[k] + rank of j among k's slots)-th
   sample. Phases change the weights from a given sample on.
2. Ordering. A source's samples run through its sequences in epochs; each epoch is a fresh seeded
   permutation, so no sequence repeats before every other has been seen.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIX_BLOCK = 4096  # weight resolution is 1/MIX_BLOCK
_MIX_STREAM, _ORDER_STREAM = 0x6D6978, 0x6F7264  # separate the two uses of the seed
_CACHED = 8


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


class EpochOrder:
    """A source's own stream: sample m is sequence perm_e[m mod N] of epoch e = m // N."""

    def __init__(self, num_sequences: int, seed: int, source: int):
        self.num_sequences, self.seed, self.source = num_sequences, seed, source
        self._perms = _LRU()

    def _permutation(self, epoch: int) -> np.ndarray:
        return self._perms.get_or(epoch, lambda: np.random.default_rng(
            [self.seed, _ORDER_STREAM, self.source, epoch]).permutation(self.num_sequences))

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        epoch, within = np.divmod(np.asarray(indices, dtype=np.int64), self.num_sequences)
        out = np.empty_like(within)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            out[sel] = self._permutation(e)[within[sel]]
        return out
