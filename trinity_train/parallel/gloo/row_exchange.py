"""The two all-to-alls both embedding collectives of a CPU job use to move only some rows of the
table: one of row masks (which rows each rank wants from, or sends to, each other rank; packed a
bit a row) and one of the rows themselves, in ascending row order. `embedding_all_gather` fetches
the rows a forward reads with them, `embedding_reduce_scatter` sends the gradient rows a backward
touched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def exchange_row_masks(masks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One all-to-all of boolean row masks, [n, R] (row t for rank t): returns [n, R], row t from
    rank t. Sent packed, a bit a row."""
    n, rows = masks.shape
    packed = F.pad(masks.to(torch.uint8), (0, -rows % 8)).view(n, -1, 8).bitwise_left_shift(_SHIFTS)
    packed = packed.sum(dim=2, dtype=torch.uint8)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    return received.unsqueeze(2).bitwise_right_shift(_SHIFTS).bitwise_and(1).view(n, -1)[:, :rows].bool()


def exchange_rows(sending: list[torch.Tensor], receiving: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """One all-to-all of whole rows: `sending[t]` ([k, width]) to rank t, `receiving[t]` rows from
    rank t; returns what each rank sent, in rank order."""
    values = sending[0].new_empty(sum(receiving), sending[0].shape[1])
    dist.all_to_all_single(values, torch.cat(sending), receiving, [len(s) for s in sending], group=group)
    return list(values.split(receiving))
