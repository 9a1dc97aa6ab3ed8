"""Whether a checkpoint's configuration fits the run that wants to load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trinity_train.config import Config, config_from_dict, config_to_dict
from trinity_train.errors import CheckpointError, ConfigError


def config_differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs, in key order."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        dotted = f"{prefix}.{key}" if prefix else key
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(config_differences(a, b, dotted))
        elif a != b:
            diffs.append((dotted, a, b))
    return diffs


def describe_differences(diffs: list[tuple[str, Any, Any]], limit: int = 3) -> str:
    shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:limit])
    return shown + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


def config_from_meta(meta: dict, path: Path) -> Config:
    """The resolved config stored in a checkpoint's meta.json."""
    try:
        return config_from_dict(meta["config"])
    except KeyError:
        raise CheckpointError(f"checkpoint '{path}' has no config in its meta.json") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}' was written with a config this version cannot read ({e})") from None


def check_model_compatible(checkpoint_cfg: Config, cfg: Config, path: Path) -> None:
    """The model section decides tensor shapes and meanings; it must match exactly."""
    diffs = config_differences(config_to_dict(checkpoint_cfg)["model"], config_to_dict(cfg)["model"], "model")
    if diffs:
        raise CheckpointError(
            f"checkpoint '{path}' holds a different model than this run ({describe_differences(diffs)}); "
            "use the checkpoint's model settings or another checkpoint")
