"""How long a phase of the loop may last before the watchdog calls it a hang (DESIGN §12).

A phase's limit is `watchdog.multiple` times the longest duration of that phase seen so far in
this process, but at least `watchdog.floor_s`; a phase not seen yet gets `watchdog.first_s`
(0: no limit; the first step compiles, the first save creates directories, a resume reads a checkpoint
cold). The rule adapts to the model and the machine without a number per phase: a 40 s step of
a large model may take 200 s before it is a hang, a 50 ms CPU step the floor.
"""

from __future__ import annotations

import math

from trinity_train.config import WatchdogConfig


class PhaseLimits:
    """The longest duration of each phase seen, and the limit that follows."""

    def __init__(self, cfg: WatchdogConfig):
        self.multiple, self.floor_s, self.first_s = cfg.multiple, cfg.floor_s, cfg.first_s
        self.longest: dict[str, float] = {}

    def observe(self, phase: str, seconds: float) -> None:
        """`phase` lasted `seconds`."""
        if seconds > self.longest.get(phase, -1.0):
            self.longest[phase] = seconds

    def limit(self, phase: str) -> float:
        """Seconds `phase` may last."""
        longest = self.longest.get(phase)
        if longest is None:
            return self.first_s if self.first_s > 0 else math.inf
        return max(self.floor_s, self.multiple * longest)
