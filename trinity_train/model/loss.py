"""Cross entropy over a large vocabulary without materialising `[tokens, vocab]` fp32 logits.

The head runs on `chunk_tokens` rows at a time and each chunk's logits are upcast to fp32 only
inside that chunk. Every chunk is wrapped in non-reentrant activation checkpointing, so backward
keeps just the chunk's hidden states and recomputes its logits, instead of holding every chunk's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_ce_sum(hidden: torch.Tensor, labels: torch.Tensor,
                  head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor,
                          head: Callable[[torch.Tensor], torch.Tensor],
                          chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross entropies fp32, number of counted labels long) over labels != -100.

    hidden [N, d] final hidden states; labels [N]; `head` maps hidden states to logits (the
    `lm_head` module itself, so parallel wrappers on it keep working).
    """
    ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start:start + chunk_tokens]
        y = labels[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            ce_sum = ce_sum + checkpoint(_chunk_ce_sum, h, y, head, use_reentrant=False,
                                         preserve_rng_state=False)
        else:
            ce_sum = ce_sum + _chunk_ce_sum(h, y, head)
    return ce_sum, (labels != IGNORE_INDEX).sum()
