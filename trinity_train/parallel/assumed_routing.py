"""Routing assumed instead of measured: what a data-free trace of the expert-parallel dispatch uses.

A real dispatch learns how many token copies go to each rank from the router's choices (an
all-to-all of the counts, then a host sync). A planner that traces one rank of a large job on
fake tensors has no choices to count (`.tolist()` of a fake tensor has no value), so it states
an assumption instead: every source rank sends the same number of copies to every ep rank
(`skew = 1`, balanced), or the traced rank's experts are the hottest of the layer and receive
`skew` times the mean (the traced rank is the one whose buffers and expert activations are
largest, which is the one that must fit). Inside `assume_routing(...)` the dispatch takes its
splits from the assumption; outside it (every real run) nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class AssumedRouting:
    skew: float = 1.0  # tokens received by the traced rank's experts / the mean (>= 1)

    def splits(self, copies: int, ep: int, num_local: int) -> tuple[list[list[int]], list[list[int]]]:
        """For a rank that routes `copies` token copies over `ep` ranks of `num_local` experts:
        (sent[rank][local expert], received[source][local expert]). Sent copies are spread evenly
        over the ranks and their experts; received ones are `skew` x the even share from every
        source, spread evenly over the local experts."""
        sent = [_spread(per_rank, num_local) for per_rank in _spread(copies, ep)]
        per_source = round(copies / ep * self.skew)
        received = [_spread(per_source, num_local) for _ in range(ep)]
        return sent, received

    def describe(self) -> str:
        return "balanced" if self.skew == 1.0 else f"skew={self.skew:g}"


def _spread(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


_ASSUMED: contextvars.ContextVar[AssumedRouting | None] = contextvars.ContextVar("assumed_routing", default=None)


def assumed_routing() -> AssumedRouting | None:
    """The routing assumption in force, or None (a real run: measure the router's choices)."""
    return _ASSUMED.get()


@contextlib.contextmanager
def assume_routing(routing: AssumedRouting) -> Iterator[None]:
    token = _ASSUMED.set(routing)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def parse_routing(text: str) -> AssumedRouting:
    """`balanced` or `skew=F` (F >= 1), as `trinity-train plan --routing` takes it."""
    if text == "balanced":
        return AssumedRouting()
    name, _, value = text.partition("=")
    try:
        skew = float(value)
    except ValueError:
        skew = float("nan")
    if name != "skew" or not skew >= 1.0 or skew == float("inf"):
        raise ValueError(f"--routing {text!r}: expected 'balanced' or 'skew=F' with a finite F >= 1 "
                         f"(the traced rank's experts receive F times the mean)")
    return AssumedRouting(skew)
