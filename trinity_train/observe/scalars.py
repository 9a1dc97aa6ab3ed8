"""Flatten a metrics record into named scalars for TensorBoard and W&B."""

from __future__ import annotations

import math
import numbers


def named_scalars(record: dict, prefix: str) -> dict[str, float]:
    """`{"loss": 2.0, "moe_cv_per_layer": [a, b]}` -> `{"train/loss": 2.0, "train/moe_cv_per_layer/0": a, ...}`.

    Counters (iter, step), booleans, strings and non-finite values are left out.
    """
    out = {}
    for key, value in record.items():
        if key in ("iter", "step", "kind") or isinstance(value, bool):
            continue
        if isinstance(value, (list, tuple)):
            out.update({f"{prefix}/{key}/{i}": float(v) for i, v in enumerate(value)
                        if isinstance(v, numbers.Real) and math.isfinite(v)})
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            out[f"{prefix}/{key}"] = float(value)
    return out
