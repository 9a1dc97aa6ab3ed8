"""Expert parallelism: routed experts split whole over the `ep` ranks, tokens sent to them and back.

The model's MoE sorts its token copies by expert and calls `experts(x_sorted, counts)` (the seam in
`model/moe.py`). With `ExpertParallel` applied to that `GroupedExperts` module the call becomes
(torchtitan's ExpertParallel pattern):

1. dispatch: the per-expert counts are exchanged with an all-to-all, then the tokens themselves
   with an autograd-aware `all_to_all_single` of uneven splits; what arrives is ordered
   (source rank, local expert) and is permuted to (local expert, source rank), so every local
   expert sees one contiguous group. Work of the caller that needs no expert (the MoE's shared
   expert, `alongside`) runs between the token all-to-all's issue and its wait, and its backward
   between the issue and the wait of the gradients' all-to-all home;
2. the module's own forward runs on the local expert shards (one grouped GEMM per projection);
3. combine: the permutation is undone and the results travel back with the reverse all-to-all.

When tensor parallelism is on too, each expert's width is also split over `tp` (gate/up by rows,
down by columns). Every tp rank holds the same tokens, so the expert input gets an identity forward
/ all-reduce backward, and the partial outputs are all-reduced (Megatron's f and g operators).

The expert weights are DTensors on the `ep` and/or `tp` mesh dims: `Shard(0)` over ep (whole
experts) and the width shard over tp, so FSDP, the optimizer and checkpoints see their global
`[E, ...]` shape.

`ExpertParallel(wire_dtype=torch.bfloat16)` (`parallel.ep_wire_dtype = "bf16"`) sends the tokens
of the dispatch and the combine in bf16 and casts them back to the dtype they were computed in on
arrival; the casts' backward sends the gradients of both in bf16 too. The experts then compute on
bf16-rounded inputs and the combine returns bf16-rounded outputs: half the bytes of an fp32 job's
all-to-alls for one bf16 rounding of each (the counts stay exact). Under tp the combine carries each
tp rank's partial sums, each rounded before the tp all-reduce adds them in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from trinity_train.parallel.assumed_routing import assumed_routing
from trinity_train.parallel.local_shards import local_shards, wrap_forward

# Which dim of each stacked expert weight holds the expert width I (split over tp).
EXPERT_WIDTH_DIM = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


@dataclass
class DispatchPlan:
    """What `combine_tokens` needs to undo `dispatch_tokens`."""

    input_splits: list[int]  # rows this rank sent to each ep rank
    output_splits: list[int]  # rows this rank received from each ep rank
    order: torch.Tensor  # received row i is local row order[i] after the permutation


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=0) - x


def _exchange_counts(counts: torch.Tensor, group, ep: int, num_local: int, copies: int
                     ) -> tuple[torch.Tensor, list[int], list[int]]:
    """(received [ep, num_local]: copies rank s sends to my local expert j, rows sent to each
    rank, rows received from each rank). Measured with an all-to-all of the counts; under
    `assume_routing` (a data-free trace) taken from the assumption instead."""
    assumed = assumed_routing()
    if assumed is not None:
        input_splits, output_splits, received = assumed.splits(copies, ep, num_local)
        return torch.tensor(received, device=counts.device), input_splits, output_splits
    with torch.no_grad():
        # received[s * num_local + j]: copies that rank s sends to my local expert j
        received = all_to_all_single(counts, None, None, group)
        received = funcol.wait_tensor(received)  # through the module: the exposed-communication timer sees it
        per_rank_sent = counts.view(ep, num_local).sum(dim=1)
        received = received.view(ep, num_local)
        splits = torch.stack([per_rank_sent, received.sum(dim=1)]).cpu()  # one device sync
    input_splits, output_splits = splits.tolist()
    return received, input_splits, output_splits


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                wire_dtype: torch.dtype | None) -> torch.Tensor:
    """The autograd-aware all-to-all of `x`, sent as `wire_dtype` (None: as it is) and returned in
    `x`'s dtype; the backward's gradient travels as `wire_dtype` too (each cast's backward casts
    the gradient)."""
    if wire_dtype is None or wire_dtype == x.dtype:
        return all_to_all_single_autograd(x, output_splits, input_splits, group)
    return all_to_all_single_autograd(x.to(wire_dtype), output_splits, input_splits, group).to(x.dtype)


class _InFlight:
    """One all-to-all whose two ends are two autograd nodes (`_Send`, `_Receive`), so that work
    created between them runs, forward and backward, while the rows travel."""

    def __init__(self, output_splits: list[int], input_splits: list[int], group):
        self.output_splits, self.input_splits = output_splits, input_splits
        self.group_name = group.group_name
        self.grad: torch.Tensor | None = None  # the backward's all-to-all, issued and not yet waited

    def issue(self, x: torch.Tensor, back: bool = False) -> torch.Tensor:
        """Start the all-to-all of `x` (`back`: the reverse one, of the gradients); torch's
        functional op, not funcol's wrapper: a plain tensor, filled once waited on."""
        splits = (self.input_splits, self.output_splits) if back else (self.output_splits, self.input_splits)
        return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), *splits, self.group_name)


class _Send(torch.autograd.Function):
    """Forward: issue the all-to-all of `x`; the received tensor comes back unwaited. Backward:
    wait for the gradient's all-to-all that `_Receive`'s backward issued."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.issue(x)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grad, ctx.flight.grad = ctx.flight.grad, None
        return funcol.wait_tensor(grad), None  # through the module: the exposed-communication timer sees it


class _Receive(torch.autograd.Function):
    """Forward: wait for the rows `_Send` issued. Backward: issue the gradient's all-to-all home
    and return at once; the autograd nodes created between the two ends run before `_Send`'s
    backward waits (the engine runs the latest-created ready node first)."""

    @staticmethod
    def forward(ctx, in_flight: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return funcol.wait_tensor(in_flight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        flight.grad = flight.issue(grad, back=True)
        return grad, None  # a stand-in of the right shape: `_Send`'s backward returns the real one


def _all_to_all_alongside(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                          wire_dtype: torch.dtype | None, alongside: Callable[[], None]) -> torch.Tensor:
    """`_all_to_all` with `alongside()` run while the rows travel, and its backward while their
    gradients travel back (the same collectives and casts, in the same order: the same numbers)."""
    cast = wire_dtype is not None and wire_dtype != x.dtype
    flight = _InFlight(output_splits, input_splits, group)
    in_flight = _Send.apply(x.to(wire_dtype) if cast else x, flight)
    alongside()
    received = _Receive.apply(in_flight, flight)
    return received.to(x.dtype) if cast else received


def dispatch_tokens(x_sorted: torch.Tensor, counts: torch.Tensor, group, wire_dtype: torch.dtype | None = None,
                    alongside: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send each token copy to the rank that owns its expert (as `wire_dtype`, if given), running
    `alongside()` (the caller's work that does not need the experts) while the tokens travel.

    x_sorted [N, d] token copies sorted by global expert id, counts [E] long copies per expert.
    Returns (tokens [M, d] grouped by local expert, counts per local expert [E / ep], plan).
    """
    ep = group.size()
    num_local = counts.numel() // ep
    received, input_splits, output_splits = _exchange_counts(counts, group, ep, num_local, x_sorted.shape[0])
    if alongside is None:
        tokens = _all_to_all(x_sorted, output_splits, input_splits, group, wire_dtype)
    else:
        tokens = _all_to_all_alongside(x_sorted, output_splits, input_splits, group, wire_dtype, alongside)

    # Arrived blocks are ordered (source s, expert j); gather them in (expert j, source s) order.
    with torch.no_grad():
        block_start = _exclusive_cumsum(received.flatten()).view(ep, num_local).t().flatten()
        block_len = received.t().flatten()
        out_start = _exclusive_cumsum(block_len)
        total = sum(output_splits)
        order = (torch.repeat_interleave(block_start - out_start, block_len, output_size=total)
                 + torch.arange(total, device=counts.device))
    local_counts = received.sum(dim=0)
    return tokens[order], local_counts, DispatchPlan(input_splits, output_splits, order)


def combine_tokens(y_local: torch.Tensor, plan: DispatchPlan, group, wire_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """Inverse of `dispatch_tokens`: results back to the ranks and rows their tokens came from."""
    arrived_order = torch.empty_like(y_local).index_copy(0, plan.order, y_local)
    return _all_to_all(arrived_order, plan.input_splits, plan.output_splits, group, wire_dtype)


def _tp_input(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward all-reduces the partial input gradients of the width shards."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


def _tp_output(y: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """All-reduce the partial sums of the width shards; backward passes the gradient through."""
    return DTensor.from_local(y, tp_mesh, [Partial()], run_check=False).full_tensor()


class ExpertParallel(ParallelStyle):
    """Apply to a `GroupedExperts` module with a mesh whose dims are "ep", "tp" or both; the
    tokens travel between the ep ranks as `wire_dtype` (None: in the dtype they are computed in)."""

    def __init__(self, wire_dtype: torch.dtype | None = None):
        super().__init__()
        self.wire_dtype = wire_dtype

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = device_mesh.mesh_dim_names or ()
        if not set(names) <= {"ep", "tp"} or not names:
            raise ValueError(f"ExpertParallel needs a mesh with dims 'ep' and/or 'tp', got {names}")
        for name, width_dim in EXPERT_WIDTH_DIM.items():
            placements = [Shard(0) if dim == "ep" else Shard(width_dim) for dim in names]
            # src_data_rank=None: every rank cuts its shard from its own copy (no communication).
            module.register_parameter(name, nn.Parameter(distribute_tensor(
                getattr(module, name).data, device_mesh, placements, src_data_rank=None)))
        ep_group = device_mesh["ep"].get_group() if "ep" in names else None
        tp = device_mesh["tp"] if "tp" in names else None
        wire_dtype = self.wire_dtype

        def around(mod: nn.Module, forward, x_sorted: torch.Tensor, counts: torch.Tensor,
                   alongside: Callable[[], None] | None = None):
            if tp is not None:
                x_sorted = _tp_input(x_sorted, tp)
            if ep_group is not None:
                x_sorted, counts, plan = dispatch_tokens(x_sorted, counts, ep_group, wire_dtype, alongside)
                alongside = None  # done while the tokens travelled
            with local_shards(mod):
                out = forward(x_sorted, counts, alongside)
            if ep_group is not None:
                out = combine_tokens(out, plan, ep_group, wire_dtype)
            if tp is not None:
                out = _tp_output(out, tp)
            return out

        wrap_forward(module, around, prefix="ExpertParallel")
        return module
