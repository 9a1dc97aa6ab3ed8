"""The straggler rule (DESIGN §8 "Rank statistics and stragglers"): which rank is slower than the
others, for long enough to be worth telling someone.

Each `ranks` report gives every rank's mean compute seconds per iteration
(`health/rank_stats.py`). A rank whose compute time is more than `ratio` times the median of the
*other* ranks' (its own value left out, so with two ranks it is compared with the other one, and
one slow rank among many does not move its own yardstick) in `reports` reports in a row is a
straggler: flagged once, when the streak reaches `reports`, and not again until a report finds
it back within `ratio` (the episode ended; the next streak is a new one). One rank alone has no
others and is never flagged.

Pure and torch-free: the callback feeds it each report and writes an event for what it returns.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Straggler:
    """A rank the rule flagged at one report."""

    rank: int
    compute_s: float  # the rank's mean compute seconds per iteration in the report that flagged it
    median_s: float  # the median of the other ranks' in that report
    ratio: float  # compute_s / median_s
    reports: int  # reports in a row above the ratio


@dataclass
class StragglerRule:
    ratio: float  # metrics.straggler_ratio (> 1)
    reports: int  # metrics.straggler_reports (>= 1)
    streaks: dict[int, int] = field(default_factory=dict)  # rank -> reports in a row above the ratio
    flagged: set[int] = field(default_factory=set)  # ranks inside a flagged episode

    def judge(self, compute_s: list[float]) -> list[Straggler]:
        """Take one report (compute seconds by rank) and return the ranks it newly flags."""
        found = []
        for rank, mine in enumerate(compute_s):
            others = compute_s[:rank] + compute_s[rank + 1:]
            median = statistics.median(others) if others else 0.0
            if median > 0 and mine > self.ratio * median:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
            else:  # back within the ratio (or nobody to compare with): the episode is over
                self.streaks.pop(rank, None)
                self.flagged.discard(rank)
                continue
            if self.streaks[rank] >= self.reports and rank not in self.flagged:
                self.flagged.add(rank)
                found.append(Straggler(rank, mine, median, mine / median, self.streaks[rank]))
        return found
