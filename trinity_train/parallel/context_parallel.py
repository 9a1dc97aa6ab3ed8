"""Context parallelism (`parallel.cp`): each row of a micro-batch split over the `cp` ranks of a
group, and the collectives its attention and losses use (DESIGN §4, docs/concepts/parallel.md).

The cp ranks of a group read the same rows (they share one data-parallel index). Before the
forward each keeps its zigzag share of every row (`model.context_attention.zigzag_index`: chunks
r and 2cp-1-r of 2*cp), after the positions were computed on the whole row; the whole row's
document ids are kept too (the global layers' document mask needs every key's document). Labels
are already aligned with the inputs (labels[t] is what position t predicts), so a chunk edge needs
nothing. `shard_micro_batch` does this; `sequence_shard` hands the model its `SequenceShard`.

`GroupExchange` is the model's `ContextExchange` over the cp group: each collective is an autograd
function whose backward is the transposed collective (all-gather <-> reduce-scatter of the
gradients, all-to-all <-> the reverse all-to-all, all-reduce <-> all-reduce), both defined here
so that a planner's collective log can tell CP's traffic from the others' by the caller.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup
# Waits go through `funcol.wait_tensor` looked up at call time, so the exposed-communication timer
# (health/collective_waits.py) sees them.
from torch.distributed._functional_collectives import (all_gather_single, all_reduce, all_to_all_single,
                                                       reduce_scatter_single)

from trinity_train.model.attention import positions_from_documents
from trinity_train.model.context_attention import SequenceShard, zigzag_index
from trinity_train.parallel.mesh import ParallelDims


def context_token_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global row index of each of rank `rank`'s seq_len / cp tokens. LongTensor [seq_len / cp]."""
    return zigzag_index(seq_len, cp, rank)


def split_for_context(tensor: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s zigzag share of rows tensor [B, T, ...] -> [B, T / cp, ...]."""
    return tensor.index_select(1, context_token_index(tensor.shape[1], cp, rank).to(tensor.device))


def shard_micro_batch(mb: dict[str, torch.Tensor], cp: int, rank: int,
                      doc_masking: bool) -> dict[str, torch.Tensor]:
    """A micro-batch of whole rows -> this rank's share: input_ids, labels, position_ids and
    document_ids split; `token_index` [T / cp] added, and the whole rows' `row_document_ids` with
    document masking. Position ids missing from `mb` are computed on the whole rows first."""
    rows, seq_len = mb["input_ids"].shape
    out = dict(mb)
    if "position_ids" not in out:
        docs = out.get("document_ids")
        out["position_ids"] = (positions_from_documents(docs) if doc_masking and docs is not None
                               else torch.arange(seq_len).expand(rows, seq_len))
    if doc_masking and "document_ids" in mb:
        out["row_document_ids"] = mb["document_ids"]
    for name in ("input_ids", "labels", "position_ids", "document_ids"):
        if name in out:
            out[name] = split_for_context(out[name], cp, rank)
    out["token_index"] = context_token_index(seq_len, cp, rank)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(all_gather_single(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(reduce_scatter_single(grad.contiguous(), "sum", 0, ctx.group)), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return funcol.wait_tensor(all_to_all_single(x.contiguous(), output_splits, input_splits, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return funcol.wait_tensor(all_to_all_single(grad.contiguous(), input_splits, output_splits, ctx.group)), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(all_reduce(grad.contiguous(), "sum", ctx.group)), None


class GroupExchange:
    """`model.context_attention.ContextExchange` over one cp process group."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.cp = group.size()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return _AllGather.apply(x, self.group)

    def all_to_all(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, output_splits, input_splits, self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduce.apply(x, self.group)


def sequence_shard(mb: dict[str, torch.Tensor], dims: ParallelDims) -> SequenceShard | None:
    """The model's `context` for a micro-batch `shard_micro_batch` made (on the device); None
    without context parallelism."""
    if dims.cp == 1:
        return None
    return SequenceShard(dims.cp, dims.cp_rank, mb["token_index"], mb.get("row_document_ids"),
                         GroupExchange(dims.cp_mesh.get_group()))
