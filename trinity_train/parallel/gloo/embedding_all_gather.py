"""The embedding's weight all-gather on gloo, fetching only the rows this rank's tokens read.

The embedding's forward reads one row per token, `weight[input_ids]`: with the default job's
1,024 tokens a rank and 8,192 rows, about a tenth of the table (the bytes-per-step table of
benchmarks/multinode.py counts it). FSDP all-gathers the whole table all the same, at the step's
start, where nothing else is left to compute. `ReadRowsAllGather` is FSDP2's custom all-gather of
the embedding's unit on a CPU job without TP (`communication.py`):

1. a forward pre-hook on the embedding (`read_rows_only`, prepended: it runs before FSDP's own)
   hands the token ids of the forward about to run to the all-gather FSDP's pre-forward makes
   next;
2. rank t owns rows [t*R, (t+1)*R) of the (padded) table; one all-to-all of the masks of the rows
   each rank reads from each owner, one of those rows, in ascending order (the two exchanges of
   `row_exchange.py`);
3. the gathered table holds this rank's own rows and every row its tokens read, bit for bit the
   dense all-gather's; every other row is zero and nothing reads it: the embedding's backward
   reads only the ids (it is never gathered for backward), the head is untied, checkpoints and
   the optimizer read the shards.

Each forward gathers again (the embedding is resharded after every forward, so each micro-batch
gathers its own rows), and the ids serve one gather only: an unshard made outside the
embedding's forward (a prefetch) goes dense. So does a data-free trace (`trinity-train plan`),
which the planner counts as the whole table (an upper bound) in its own category (`FSDP
all-gather, embedding rows`, plan/collectives.py). NCCL keeps FSDP's dense all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from trinity_train.parallel.assumed_routing import assumed_routing
from trinity_train.parallel.gloo.row_exchange import exchange_row_masks, exchange_rows


class ReadRowsAllGather(DefaultAllGather):
    """See the module. `row_numel`: the elements of one row (the hidden size). `token_ids`: what
    the next call fetches rows for, consumed by it (None: the whole table, FSDP's own)."""

    def __init__(self, row_numel: int):
        self.row_numel = row_numel
        self.token_ids: torch.Tensor | None = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        ids, self.token_ids = self.token_ids, None
        n = group.size()
        if (ids is None or output_tensor.numel() != n * input_tensor.numel()
                or input_tensor.numel() % self.row_numel or assumed_routing() is not None):
            return super().__call__(output_tensor, input_tensor, group, async_op)
        me = group.rank()
        shard = input_tensor.view(-1, self.row_numel)
        wanted = torch.zeros(n * len(shard), dtype=torch.bool)
        wanted[ids.reshape(-1)] = True
        wanted = wanted.view(n, len(shard))
        wanted[me] = False  # this rank's own rows are here already
        asked = exchange_row_masks(wanted, group)  # [n, R]: the rows of my shard rank t reads
        values = exchange_rows([shard[asked[t]] for t in range(n)], wanted.sum(dim=1).tolist(), group)
        table = output_tensor.view(n, len(shard), self.row_numel)
        for t in range(n):
            if t != me:  # (FSDP hands in its input as the output's slot `me`: that one is kept)
                table[t].zero_()
                table[t][wanted[t]] = values[t]
        table[me].copy_(shard)
        return None  # done: FSDP copies the table out when this returns


def read_rows_only(embed: FSDPModule) -> ReadRowsAllGather:
    """Install `ReadRowsAllGather` on the embedding's FSDP unit with the hooks that hand it each
    forward's token ids (before FSDP's pre-forward unshards) and drop them after (an unshard
    skipped because the table was already gathered must not leave them to a later one)."""
    gather = ReadRowsAllGather(embed.embedding_dim)
    embed.set_custom_all_gather(gather)

    def hand_ids(module: nn.Module, args: tuple) -> None:
        gather.token_ids = args[0]

    def drop_ids(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        gather.token_ids = None

    embed.register_forward_pre_hook(hand_ids, prepend=True)
    embed.register_forward_hook(drop_ids, always_call=True)
    return gather
