"""Flatten a metrics record into named scalars and histograms for TensorBoard and W&B.

- a number: `{prefix}/{key}`;
- a list of numbers: one scalar per position, `{prefix}/{key}/{i}`; in a `layers` record `i` is
  the layer index (the lists indexed by MoE layer are named through its `moe_layers`); a list of
  `records.INDEXED_BY` is named by the values of its index field (a bucket's first position, a
  prompt length), which is not written itself;
- an object: its members, `{prefix}/{key}/{member}...`, by the same rules;
- a list of lists (tokens per expert): one histogram per row, `{prefix}/{key}/{i}`.

Counters (iter, step), booleans, strings, nulls and non-finite values are left out.
"""

from __future__ import annotations

import math
import numbers

from trinity_train.observe.layer_record import MOE_LAYERS, layer_indices
from trinity_train.records import INDEXED_BY

_NOT_VALUES = ("iter", "step", "kind", MOE_LAYERS, *INDEXED_BY.values())


def _is_value(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _is_row_list(value) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple)) for v in value)


def _flatten(name: str, value, indices, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
    if isinstance(value, dict):
        for key, member in value.items():
            _flatten(f"{name}/{key}", member, None, scalars, histograms)
    elif _is_row_list(value):
        indices = indices or range(len(value))
        for i, row in zip(indices, value):
            if isinstance(row, (list, tuple)):
                finite = [float(v) for v in row if _is_value(v)]
                if finite:
                    histograms[f"{name}/{i}"] = finite
    elif isinstance(value, (list, tuple)):
        indices = indices or range(len(value))
        scalars.update({f"{name}/{i}": float(v) for i, v in zip(indices, value) if _is_value(v)})
    elif _is_value(value):
        scalars[name] = float(value)


def _indices(record: dict, key: str, length: int) -> list:
    named_by = record.get(INDEXED_BY.get(key, ""))
    if isinstance(named_by, list) and len(named_by) == length:
        return named_by
    return layer_indices(record, key, length)


def named_values(record: dict, prefix: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars, histograms) of a record, named as the module docstring says: e.g.
    `{"loss": 2.0, "moe_cv_per_layer": [a, b]}` -> `{"train/loss": 2.0, "train/moe_cv_per_layer/0": a,
    "train/moe_cv_per_layer/1": b}`."""
    scalars: dict[str, float] = {}
    histograms: dict[str, list[float]] = {}
    for key, value in record.items():
        if key in _NOT_VALUES or isinstance(value, bool):
            continue
        indices = _indices(record, key, len(value)) if isinstance(value, (list, tuple)) else None
        _flatten(f"{prefix}/{key}", value, indices, scalars, histograms)
    return scalars, histograms
