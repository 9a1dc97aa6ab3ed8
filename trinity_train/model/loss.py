"""Cross entropy over a large vocabulary without materialising `[tokens, vocab]` fp32 logits.

The head runs on `chunk_tokens` rows at a time and each chunk's logits are upcast to fp32 only
inside that chunk. With `fused=True` (the head is a plain bias-free `nn.Linear` whose weight the
forward can use as a tensor: one process, FSDP) the gradients of each chunk are computed right
away in the forward (`_FusedLinearCrossEntropy`: logits, softmax minus one-hot, two more GEMMs), so
backward neither keeps nor recomputes any logits: three head GEMMs per token instead of four.
Otherwise (the tensor-parallel plan turns it off: its head is a vocabulary-split DTensor that only
works called as a module) each chunk goes through the head under non-reentrant activation
checkpointing, so backward keeps just the chunk's hidden states and recomputes its logits.

Evaluation can also ask for totals by group of tokens (`cross_entropy_by_group`: a group index per
token, e.g. its position bucket or its prompt), computed from the same chunks' logits; the
training step never pays for them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trinity_train.model.precision import compute_dtype

IGNORE_INDEX = -100


def _chunk_ce_sum(hidden: torch.Tensor, labels: torch.Tensor,
                  head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


# The largest row block `logsumexp_by_row_blocks` hands torch.logsumexp at once.
LOGSUMEXP_BLOCK_BYTES = 32 * 2 ** 20


def logsumexp_by_row_blocks(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dim, keepdim, a block of rows at a time: the op allocates a
    temporary as large as its input, so whole [chunk, vocab] logits would need a second buffer of
    their size that no memory tracker sees (6 GiB for nano's 8192-token chunks); each row's result
    is bitwise what one call gives."""
    rows = max(1, LOGSUMEXP_BLOCK_BYTES // (logits.shape[-1] * logits.element_size()))
    return torch.cat([torch.logsumexp(logits[start:start + rows], dim=-1, keepdim=True)
                      for start in range(0, logits.shape[0], rows)])


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T, labels), with both gradients computed chunk by chunk
    in the forward and only scaled by the incoming gradient in the backward.

    GEMMs run in `dtype` (the autocast dtype under autocast, as `nn.Linear` would), the
    softmax and the loss in fp32, and the weight gradient accumulates in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[:2]
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens].to(dtype)
            y = labels[start:start + chunk_tokens]
            counted = y != IGNORE_INDEX
            target = torch.where(counted, y, 0)[:, None]
            logits = (h @ w.t()).float()
            lse = logsumexp_by_row_blocks(logits)
            ce_sum += ((lse - logits.gather(1, target)).squeeze(1) * counted).sum()
            # d CE / d logits = softmax - one_hot(label), zero on rows that do not count; built
            # in place in the logits buffer.
            grad_logits = logits.sub_(lse).exp_()
            grad_logits.scatter_add_(1, target, torch.full_like(target, -1, dtype=grad_logits.dtype))
            grad_logits.mul_(counted[:, None])
            grad_logits = grad_logits.to(dtype)
            if need_hidden_grad:
                grad_hidden[start:start + chunk_tokens] = grad_logits @ w
            if need_weight_grad:
                if dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight += (grad_logits.t() @ h).float()
            # Free this chunk's [chunk, vocab] buffers before the next chunk allocates its own:
            # kept alive by the loop's names they would double the loss's peak (9 GiB more for
            # nano's 8192-token chunks on a GPU, as `trinity-train plan` found).
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return ce_sum

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_out.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_out).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor,
                          head: Callable[[torch.Tensor], torch.Tensor],
                          chunk_tokens: int, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross entropies fp32, number of counted labels long) over labels != -100.

    hidden [N, d] final hidden states; labels [N]; `head` maps hidden states to logits (the
    `lm_head` module itself, so parallel wrappers on it keep working). `fused` allows the fused
    path for a bias-free `nn.Linear` head.
    """
    num_tokens = (labels != IGNORE_INDEX).sum()
    if torch.is_grad_enabled() and fused and type(head) is nn.Linear and head.bias is None:
        dtype = compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            ce_sum = _FusedLinearCrossEntropy.apply(hidden, head.weight, labels, chunk_tokens, dtype)
        return ce_sum, num_tokens
    ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start:start + chunk_tokens]
        y = labels[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            ce_sum = ce_sum + checkpoint(_chunk_ce_sum, h, y, head, use_reentrant=False,
                                         preserve_rng_state=False)
        else:
            ce_sum = ce_sum + _chunk_ce_sum(h, y, head)
    return ce_sum, num_tokens


# The rows of `cross_entropy_by_group`'s totals.
GROUP_CE, GROUP_TOKENS, GROUP_CORRECT = 0, 1, 2


@torch.no_grad()
def cross_entropy_by_group(hidden: torch.Tensor, labels: torch.Tensor,
                           head: Callable[[torch.Tensor], torch.Tensor], chunk_tokens: int,
                           groups: torch.Tensor, num_groups: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Evaluation only: `chunked_cross_entropy`'s (sum, count), the sum computed exactly as its
    no-grad path does, and fp64 totals [3, num_groups] by group: summed cross entropy
    (`GROUP_CE`), counted labels (`GROUP_TOKENS`) and labels that are the logits' argmax
    (`GROUP_CORRECT`, a greedy next-token match).

    `groups` [N] long in [0, num_groups): each token's group (the caller's choice: a position
    bucket, a prompt), so a rank holding any subset of a row's tokens (context parallelism's
    chunks) sums its own and the groups add up over ranks.
    """
    if groups.shape != labels.shape:
        raise ValueError(f"cross_entropy_by_group: groups {tuple(groups.shape)} must match labels "
                         f"{tuple(labels.shape)}")
    num_tokens = (labels != IGNORE_INDEX).sum()
    ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    totals = torch.zeros(3, num_groups, dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        y = labels[start:start + chunk_tokens]
        g = groups[start:start + chunk_tokens]
        logits = head(hidden[start:start + chunk_tokens]).float()
        ce_sum = ce_sum + F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        per_token = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
        counted = y != IGNORE_INDEX
        correct = (logits.argmax(dim=-1) == y) & counted
        totals.index_add_(1, g, torch.stack([per_token.double(), counted.double(), correct.double()]))
        del logits
    return ce_sum, num_tokens, totals
