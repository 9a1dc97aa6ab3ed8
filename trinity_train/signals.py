"""The signals the step guard judges (DESIGN §7), as data: one list drives the guard's windows and
z-scores, its verdicts (`Verdict.<name>_z`), the `<name>` and `<name>_z` fields of train records,
skip and guard_observed events and incident reports, the incidents table and the dashboard.

A new signal is an entry here (its measurement included) and its sigma floor in
`config.StabilityConfig`; the names it writes are then `<name>` and `<name>_z`. The step, the
guard, records and incidents read `SIGNALS` when they run, not when imported, so a test can add
one for a while (tests/test_guard_signals.py); the dashboard's columns take it at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Signal:
    name: str  # the JSON field of its value, the guard's state key of its window, an incident's `signal`
    sigma_floor: str  # the `stability` config key of its smallest sigma (log units)
    spike: str  # the skip reason when its z-score reaches `stability.spike_zscore`
    label: str  # how the incidents table titles its value
    z_label: str  # ... and its z-score
    fmt: str  # the table's format of its value
    # Its value from the step's global totals (`step.StepTotals`); None: the attribute `name`.
    measure: Callable[[Any], float] | None = None

    @property
    def z(self) -> str:
        """The JSON field of its z-score."""
        return f"{self.name}_z"

    @property
    def width(self) -> int:
        """The table's width of its value."""
        return int(self.fmt[:self.fmt.index(".")])

    @property
    def notice_fmt(self) -> str:
        """Its format in a line of text: the table's, without the width."""
        return self.fmt[self.fmt.index("."):]

    def read(self, totals: Any) -> float:
        return self.measure(totals) if self.measure is not None else getattr(totals, self.name)


# In the order the guard tells them apart: a tie of z-scores names the first as an incident's signal.
SIGNALS: tuple[Signal, ...] = (
    Signal("loss", "loss_sigma_floor", "loss_spike", "loss", "loss z", "9.4f"),
    Signal("grad_norm", "grad_norm_sigma_floor", "grad_spike", "grad norm", "grad z", "10.3g"),
)


def measured(totals: Any) -> dict[str, float]:
    """Each signal's value, by name, from a step's totals."""
    return {s.name: s.read(totals) for s in SIGNALS}


def fields(values: Mapping[str, float], zscores: Mapping[str, float | None]) -> dict[str, Any]:
    """The `<name>` and `<name>_z` fields of a step judged with `values` and `zscores` (by name)."""
    return {**{s.name: values[s.name] for s in SIGNALS}, **{s.z: zscores.get(s.name) for s in SIGNALS}}
