"""The precision of what travels between ranks (`parallel.ep_wire_dtype`, `parallel.reduce_wire_dtype`).

Both are "full" by default: the EP all-to-alls carry activations as computed and FSDP reduces
fp32 gradients. "bf16" halves the bytes of an fp32 job's collectives for one bf16 rounding of what
is sent (docs/concepts/parallel.md, Low precision on the wire, says what each backend sums in).
"""

from __future__ import annotations

import torch

_DTYPES = {"bf16": torch.bfloat16}


def wire_dtype(setting: str) -> torch.dtype | None:
    """The dtype a setting sends in; None: as the tensor is ("full")."""
    return _DTYPES.get(setting)
