"""A config checked by every rule before a run does any work.

`config.load_config` checks each section's fields (types, ranges, consistency within the
section). The rules that belong to a package using a setting live in that package, next to the
code they protect, and `validate_rules` runs them: the block variants (`model.blocks`), the
parallel layout that needs no world size (`parallel.mesh`), the fault drills
(`stability.drills`), the routing watch's thresholds (`stability.routing`). `config` sits at the bottom of the layering and cannot call them itself, so
whatever loads a config for a run (the CLI, the Trainer) calls `load_run_config` or
`validate_rules`. Each raises `ConfigError`: one line naming the key (exit code 2 in the CLI).
"""

from __future__ import annotations

from pathlib import Path

from trinity_train.config import Config, load_config
from trinity_train.model.blocks import check_block_config
from trinity_train.parallel.mesh import check_layout_config
from trinity_train.stability.drills import check_fault_config
from trinity_train.stability.routing import check_routing_config


def validate_rules(cfg: Config) -> None:
    """Every package's rules for `cfg` (its fields already checked by `config.validate`)."""
    check_block_config(cfg.model)
    check_layout_config(cfg)
    check_fault_config(cfg)
    check_routing_config(cfg)


def load_run_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """`config.load_config`, then `validate_rules`."""
    cfg = load_config(path, overrides)
    validate_rules(cfg)
    return cfg
