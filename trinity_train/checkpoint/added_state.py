"""Resuming a checkpoint written before a component's state grew a part.

DCP loads into the keys the running code asks for, so a checkpoint from before a component added
state (the spike guard's warm-up and routing watches, guard v3) fails to load with "Missing key".
A component lists such parts in `STATE_ADDED_LATER` (top-level keys of its `state_dict()`); when
the checkpoint lacks one, it is left out of the load and keeps the fresh value the component was
built with. Nothing else may be missing: every other key still has to be in the checkpoint.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.stateful import Stateful


class _WithoutParts(Stateful):
    """`component` as DCP sees it, less the parts the checkpoint lacks."""

    def __init__(self, component: Any, absent: tuple[str, ...]):
        self.component, self.absent = component, absent

    def state_dict(self) -> dict:
        return {k: v for k, v in self.component.state_dict().items() if k not in self.absent}

    def load_state_dict(self, state: dict) -> None:
        fresh = self.component.state_dict()
        self.component.load_state_dict({**state, **{k: fresh[k] for k in self.absent}})


def fit_to_checkpoint(state: dict[str, Any], checkpoint_keys: set[str]) -> tuple[dict[str, Any], list[str]]:
    """`state` with each component's later-added parts that `checkpoint_keys` (the checkpoint's
    flattened keys) lacks left out, and the dotted names of those parts."""
    fitted, absent_names = dict(state), []
    for name, component in state.items():
        later = getattr(component, "STATE_ADDED_LATER", ())
        absent = tuple(part for part in later if not _holds(checkpoint_keys, f"{name}.{part}"))
        if absent:
            fitted[name] = _WithoutParts(component, absent)
            absent_names += [f"{name}.{part}" for part in absent]
    return fitted, absent_names


def _holds(keys: set[str], prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)
