"""Routing collapse: a MoE layer whose router sends most tokens to a few experts (DESIGN §7).

Judged every step on the step's global tokens per expert [MoE layers, experts] (summed over
micro-batches and ranks, so every rank sees the same counts). A layer is collapsed in a step when
its busiest expert gets `routing_max_load` times the mean tokens per expert, or when at least
`routing_dead_experts` experts get no token of the global batch. A layer collapsed
`routing_steps` steps in a row is reported once (a `routing_collapse` event naming the model
layer), and stays a collapse until a step finds it healthy again. Skipping a step does not mend
a router, so routing never skips: it opens an incident, whose onset is where a rollback goes back
before if the loss or gradient norm later goes wrong as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import Config, StabilityConfig, require


def check_routing_config(cfg: Config) -> None:
    """`stability.routing_dead_experts` within the model's experts (ConfigError naming the key);
    `run_config.validate_rules` runs this at load."""
    require(cfg.stability.routing_dead_experts <= cfg.model.num_experts, "stability.routing_dead_experts",
            f"must not exceed model.num_experts ({cfg.model.num_experts}), or it never fires")


@dataclass(frozen=True)
class Collapse:
    layer: int  # the model layer (blocks' index), not the MoE layer's
    max_load: float  # tokens of the busiest expert over the mean
    dead_experts: int  # experts with no token


def layer_loads(counts) -> list[tuple[float, int]]:
    """(max load, experts with no token) of each row of `counts` [MoE layers, experts]."""
    rows = counts.tolist() if hasattr(counts, "tolist") else counts
    return [(max(row) * len(row) / max(sum(row), 1e-12), sum(1 for c in row if c == 0)) for row in rows]


class RoutingWatch:
    """Per MoE layer, how many steps in a row it has been collapsed."""

    def __init__(self, cfg: StabilityConfig, first_moe_layer: int = 0):
        self.cfg = cfg
        self.first_moe_layer = first_moe_layer
        self.streaks: list[int] = []

    def _collapsed(self, max_load: float, dead: int) -> bool:
        cfg = self.cfg
        return (0 < cfg.routing_max_load <= max_load) or (0 < cfg.routing_dead_experts <= dead)

    def observe(self, counts) -> list[Collapse]:
        """Follow one step's counts; the layers whose collapse reaches `routing_steps` now."""
        loads = layer_loads(counts)
        if len(self.streaks) != len(loads):
            self.streaks = [0] * len(loads)
        reached = []
        for i, (max_load, dead) in enumerate(loads):
            self.streaks[i] = self.streaks[i] + 1 if self._collapsed(max_load, dead) else 0
            if self.streaks[i] == self.cfg.routing_steps:
                reached.append(Collapse(self.first_moe_layer + i, max_load, dead))
        return reached

    @property
    def collapsed(self) -> bool:
        """Whether any layer is in a reported collapse (it keeps an incident open)."""
        return any(s >= self.cfg.routing_steps for s in self.streaks)

    def state_dict(self) -> dict:
        return {"streaks": list(self.streaks)}

    def load_state_dict(self, state: dict) -> None:
        self.streaks = list(state["streaks"])
