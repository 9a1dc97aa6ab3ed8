"""The one install call and the one object through which a CPU job's step reaches the gloo room.

`install_gloo_communication` puts the CPU-only collectives and overlaps on a model that FSDP has
sharded (after `parallel/fsdp.py`'s `apply_fsdp`, before the first forward), and returns the
`GlooCommunication` the training step holds. Off a CPU job (a GPU job: NCCL's own collectives and
streams; one process: no collectives) it installs nothing and returns an object whose calls are
no-ops, so the step has one code path.

What it installs, the same collectives with the same sums as FSDP's own, bit for bit on two ranks:
- every unit's gradient reduce-scatter as `AllToAllReduceScatter` (`reduce_scatter.py`: half the
  bytes of gloo's own), left travelling while the next unit's backward computes
  (`GlooCommunication.before_backward` / `after_backward`), the root's from the backward's start
  (`early_root_reduce.py`); not under HSDP (its all-reduce reads the reduce-scatter's output at
  once) nor in a micro-batch whose gradients add to an earlier one's;
- with EP, a backward's FSDP traffic held behind each block's expert exchange (`ep_backward_hold.py`);
- without TP, the embedding's all-gather fetching only the rows its forward reads and its
  reduce-scatter sending only the touched rows (`embedding_all_gather.py`,
  `embedding_reduce_scatter.py`);
- each block's all-gather prefetched while the block before it computes, and the next forward's
  first one issued inside the optimizer step (`prefetch.py`).

`GlooOverlap` turns the overlaps off for a benchmark's ablation (benchmarks/multinode.py): no
config key, since a job has no reason to run without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trinity_train.optim.muon import Muon
from trinity_train.parallel.gloo.early_root_reduce import reduce_root_at_its_last_gradient
from trinity_train.parallel.gloo.embedding_all_gather import read_rows_only
from trinity_train.parallel.gloo.embedding_reduce_scatter import TouchedRowsReduceScatter
from trinity_train.parallel.gloo.ep_backward_hold import BackwardTraffic, hold_backward_traffic
from trinity_train.parallel.gloo.prefetch import NextForwardPrefetch, prefetch_neighbouring_blocks, units_of
from trinity_train.parallel.gloo.reduce_scatter import AllToAllReduceScatter
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.wire_precision import wire_dtype


@dataclass(frozen=True)
class GlooOverlap:
    """Which overlaps a CPU job runs: both wherever they apply. Only a benchmark's ablation turns
    one off, to measure what it is worth."""

    reduce_scatter: bool = True  # a unit's reduce-scatter travels while the next unit's backward computes
    all_gather: bool = True  # all-gathers are prefetched (each block's, the next forward's first)


class GlooCommunication:
    """What the training step calls around each backward and the optimizer step; every call is a
    no-op for what was not installed (a GPU job, one process, an ablated overlap)."""

    def __init__(self, reduce_scatter: AllToAllReduceScatter | None = None,
                 next_forward: NextForwardPrefetch | None = None):
        self._reduce_scatter = reduce_scatter  # the model's one, when its calls may overlap
        self._next_forward = next_forward

    def before_backward(self, fresh: bool) -> None:
        """Whether this backward's reduce-scatters may travel while it goes on: only when
        `fresh`, i.e. no gradient from an earlier micro-batch is waiting to be added to (FSDP adds
        the reduced shard at once)."""
        if self._reduce_scatter is not None:
            self._reduce_scatter.overlapping = fresh

    def after_backward(self) -> None:
        """Complete the reduce-scatters the backward left travelling: its gradients are final."""
        if self._reduce_scatter is not None:
            self._reduce_scatter.finish()

    def prefetch_next_forward(self) -> None:
        """Issue the next forward's first all-gathers now (the optimizer step does, once their
        parameters are final)."""
        if self._next_forward is not None:
            self._next_forward.issue()

    def discard_next_forward(self) -> None:
        """Before a checkpoint load replaces the parameters: drop what the optimizer step gathered
        for the next forward, so that it gathers the loaded values."""
        if self._next_forward is not None:
            self._next_forward.discard()


def install_gloo_communication(model: nn.Module, optimizer: torch.optim.Optimizer | None, dims: ParallelDims,
                               device: torch.device, reduce_wire_dtype: str = "full",
                               overlap: GlooOverlap | None = None) -> GlooCommunication:
    """Install a CPU job's collectives and overlaps on `model` (sharded by `apply_fsdp` over
    `dims`) and the next forward's prefetch in `optimizer`'s step (see the module; without an
    optimizer, `GlooCommunication.prefetch_next_forward` issues it). `overlap`: None, all of them."""
    if device.type != "cpu" or not isinstance(model, FSDPModule):
        return GlooCommunication()
    overlap = overlap or GlooOverlap()
    wire = wire_dtype(reduce_wire_dtype)
    reduce_scatter = AllToAllReduceScatter(wire)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(reduce_scatter)
    rows = dims.tp == 1  # (a vocabulary-parallel table is a DTensor of TP's)
    if rows:
        model.embed.set_custom_reduce_scatter(TouchedRowsReduceScatter(model.embed.embedding_dim, wire))
        read_rows_only(model.embed)
    expert_blocks = [i for i, block in enumerate(model.layers) if block.is_moe and dims.ep > 1]
    overlapping = overlap.reduce_scatter and dims.dp_replicate == 1
    if expert_blocks and (overlapping or overlap.all_gather):
        traffic = BackwardTraffic()
        hold_backward_traffic(model, expert_blocks, traffic, units_of if overlap.all_gather else None)
        reduce_scatter.run_or_hold = traffic.run_or_hold
    if overlapping:
        reduce_root_at_its_last_gradient(model, reduce_scatter)
    next_forward = None
    if overlap.all_gather:
        prefetch_neighbouring_blocks(model, held=set(expert_blocks))
        # (the embedding's rows are gathered in its own pre-forward, once the ids are known)
        next_forward = NextForwardPrefetch([model] if rows else [model, model.embed])
    communication = GlooCommunication(reduce_scatter if overlapping else None, next_forward)
    if optimizer is not None and next_forward is not None:
        _issue_in_optimizer_step(optimizer, communication.prefetch_next_forward)
    return communication


def _issue_in_optimizer_step(optimizer: torch.optim.Optimizer, prefetch: Callable[[], None]) -> None:
    """Muon: once its AdamW part has made the root's values final and its exchange's pieces have
    left, so the all-gather travels behind them while Newton-Schulz computes; another optimizer:
    after its step (torch's step post-hook)."""
    if isinstance(optimizer, Muon):
        optimizer.register_while_orthogonalising_hook(prefetch)
    else:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: prefetch())
