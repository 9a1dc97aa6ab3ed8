"""The embedding's all-gather on gloo fetches only the rows its forward reads
(`parallel/gloo/embedding_all_gather.py`), on two gloo ranks.

- On bare tensors: every row the ids name, and this rank's own shard, are bit for bit the dense
  all-gather's, every other row is zero, and the rank writes under a quarter of the dense bytes to
  its sockets; the ids serve one call (the next goes dense), and so does a data-free trace.
- In FSDP (the tiny model, a CPU job without TP): the embedding's unit takes it, each forward
  gathers its own ids' rows (two micro-batches with different tokens), and the losses and
  gradients are bit for bit those of FSDP's dense all-gather; the planner's log files it under its
  own category, and the all-gathers send no more than the dense ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from trinity_harness.ranks import init_gloo
from test_gloo_reduce_scatter import _socket_bytes_written
from tiny_fsdp import tiny_fsdp_model
from trinity_train.parallel.assumed_routing import AssumedRouting, assume_routing
from trinity_train.parallel.gloo.embedding_all_gather import ReadRowsAllGather
from trinity_train.plan.collectives import (FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER, CollectiveLog,
                                            sent_by_category)

ROWS, WIDTH = 96, 32  # a shard's rows, a row's elements


def _bare_gathers() -> dict:
    """A [ROWS, WIDTH] shard a rank gathered densely and by rows for ids that name some of each
    rank's rows (repeats included); then a call with no ids, and one under a data-free trace."""
    init_gloo()
    n, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(me)
    shard = torch.randn(ROWS * WIDTH, generator=g)
    ids = torch.randint(0, n * ROWS, (2, 8), generator=g)
    out = {"ids": ids}
    gather = ReadRowsAllGather(WIDTH)
    for name in ("dense", "rows", "after", "traced"):
        output = torch.full((n * shard.numel(),), float("nan"))
        # As FSDP calls it: the input is this rank's slot of the output.
        output.narrow(0, me * shard.numel(), shard.numel()).copy_(shard)
        shard_in_place = output.narrow(0, me * shard.numel(), shard.numel())
        gather.token_ids = ids if name in ("rows", "traced") else None
        dist.barrier()
        before = _socket_bytes_written()
        if name == "traced":
            with assume_routing(AssumedRouting()):
                gather(output, shard_in_place, dist.group.WORLD)
        else:
            gather(output, shard_in_place, dist.group.WORLD)
        out[name] = (output.view(n * ROWS, WIDTH), _socket_bytes_written() - before)
    return out


def test_the_gather_fetches_the_rows_the_ids_read_bit_for_bit(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(_bare_gathers)):
        (dense, dense_bytes), (rows, row_bytes) = result["dense"], result["rows"]
        read = torch.zeros(len(dense), dtype=torch.bool)
        read[result["ids"].reshape(-1)] = True
        read[rank * ROWS:(rank + 1) * ROWS] = True  # its own shard
        assert torch.equal(rows[read].view(torch.int32), dense[read].view(torch.int32)), f"rank {rank}"
        assert not rows[~read].any(), f"rank {rank}: rows no id reads are zero"
        assert read.sum() < len(read)  # (so the check above checks something)
        # At most 16 of the other shard's 96 rows, plus a packed mask and two calls' headers.
        assert row_bytes < dense_bytes / 4, (rank, row_bytes, dense_bytes)
        for name in ("after", "traced"):  # the ids served one call; a trace has no data to go by
            assert torch.equal(result[name][0], dense), f"rank {rank}, {name}"


def _fsdp_micro_batches() -> dict:
    """Two micro-batches of different tokens, forward and backward, with the rows all-gather
    installed (as `apply_fsdp` does) and with FSDP's dense one: losses, gradients, the log."""
    model, ids = tiny_fsdp_model()
    installed = model.embed._get_fsdp_state()._fsdp_param_group._all_gather_comm
    other = torch.randint(0, model.cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(7))
    result = {"installed": type(installed)}
    for name in ("rows", "dense"):
        if name == "dense":
            model.embed.set_custom_all_gather(DefaultAllGather())
        log, losses = CollectiveLog(), []
        with log:
            for batch in (ids, other):
                loss = model(batch, labels=batch).ce_sum
                loss.backward()
                losses.append(loss.detach())
        result[name] = {"losses": losses, "logged": sent_by_category(log.calls),
                        "gather_kinds": {c.kind for c in log.calls if c.category == FSDP_EMBEDDING_ROWS_GATHER},
                        "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}
        model.zero_grad(set_to_none=True)
    return result


def test_fsdp_gathers_each_forwards_rows_with_the_dense_gathers_bits(rank_pool):
    for rank, result in enumerate(rank_pool(2).run(_fsdp_micro_batches)):
        assert result["installed"] is ReadRowsAllGather
        rows, dense = result["rows"], result["dense"]
        assert all(torch.equal(a, b) for a, b in zip(rows["losses"], dense["losses"])), f"rank {rank}"
        for name, grad in dense["grads"].items():
            assert torch.equal(rows["grads"][name], grad), f"rank {rank}: {name}"
        # (the tiny vocabulary's 64 rows are nearly all read: the bytes are checked on bare tensors)
        gathered = rows["logged"][FSDP_EMBEDDING_ROWS_GATHER]
        assert 0 < gathered and FSDP_EMBEDDING_ROWS_GATHER not in dense["logged"], rank
        assert rows["gather_kinds"] == {"all_to_all"}, rank  # the rows' exchanges, never the dense fallback
        assert rows["logged"][FSDP_ALL_GATHER] + gathered <= dense["logged"][FSDP_ALL_GATHER], rank
