"""Expert parallelism: routed experts split whole over the `ep` ranks, tokens sent to them and back.

The model's MoE sorts its token copies by expert and calls `experts(x_sorted, counts)` (the seam in
`model/moe.py`). With `ExpertParallel` applied to that `GroupedExperts` module the call becomes
(torchtitan's ExpertParallel pattern):

1. dispatch: the per-expert counts are exchanged with an all-to-all (one host sync), then the
   tokens themselves with autograd-aware all-to-alls of uneven splits; what arrives is ordered
   (source rank, local expert) and is permuted to (local expert, source rank), so every local
   expert sees one contiguous group. Work of the caller that needs no expert (the MoE's shared
   expert, `alongside`) runs between the first token all-to-all's issue and its wait, and its
   backward between the issue and the wait of the gradients' all-to-all home;
2. the module's own forward runs on the local expert shards (one grouped GEMM per projection);
3. combine: the permutation is undone and the results travel back with the reverse all-to-all.

In waves (`EP_WAVES`, DeepSeek's dual-batch overlap cut by expert instead of by batch):
every rank's local experts are cut into runs, and wave w carries the tokens of run w of every rank.
Wave w+1's tokens travel while wave w's experts compute, and wave w's results travel home while
wave w+1's compute; the backward runs the same pattern in reverse. An expert's rows are the same
rows in the same order in any number of waves, and its weight gradient is its own rows' sum (the
other waves add exact zeros): bit for bit with the per-expert loop; the grouped GEMM's activation
runs over the whole buffer, where a CPU vector kernel may round an element 1 ulp differently as
its position moves (DESIGN §5; within the layout tolerance).

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
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from trinity_train.parallel.assumed_routing import assumed_routing
from trinity_train.parallel.local_shards import local_shards, wrap_forward

# Which dim of each stacked expert weight holds the expert width I (split over tp).
EXPERT_WIDTH_DIM = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


def cut_runs(num_local: int, waves: int) -> list[range]:
    """This rank's local experts cut into up to `waves` contiguous runs of about equal size (as
    many as there are experts at most); run w of every rank travels in wave w."""
    n = max(1, min(waves, num_local))
    edges = [num_local * i // n for i in range(n + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


@dataclass
class Wave:
    """One wave of the exchange: the tokens for one run of every ep rank's local experts."""

    send_splits: list[int]  # rows this rank sends to each ep rank (for that rank's run)
    recv_splits: list[int]  # rows this rank receives from each ep rank
    order: torch.Tensor  # arrived[order]: the arrivals in (local expert, source rank) order
    local_counts: torch.Tensor  # [num_local] long, rows per local expert (0 outside the run)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=0) - x


def _routing_table(counts: torch.Tensor, group, ep: int, num_local: int, copies: int
                   ) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """(sent[r][j]: copies this rank sends to rank r's local expert j, received[s][j]: copies rank s
    sends to my local expert j, and `received` as an [ep, num_local] tensor on `counts`' device).
    Measured with an all-to-all of the counts and one host sync; under `assume_routing` (a
    data-free trace) taken from the assumption instead."""
    assumed = assumed_routing()
    if assumed is not None:
        sent, received = assumed.splits(copies, ep, num_local)
        return sent, received, torch.tensor(received, device=counts.device)
    with torch.no_grad():
        on_device = all_to_all_single(counts, None, None, group)
        # waited through the module: the exposed-communication timer sees it
        on_device = funcol.wait_tensor(on_device).view(ep, num_local)
        sent, received = torch.stack([counts.view(ep, num_local), on_device]).cpu().tolist()
    return sent, received, on_device


def _arrival_order(block: torch.Tensor, total: int) -> torch.Tensor:
    """For `total` arrivals ordered (source s, expert j of the run) with block[s, j] rows each: the
    gather that orders them (expert j, source s)."""
    with torch.no_grad():
        block_start = _exclusive_cumsum(block.flatten()).view_as(block).t().flatten()
        block_len = block.t().flatten()
        return (torch.repeat_interleave(block_start - _exclusive_cumsum(block_len), block_len, output_size=total)
                + torch.arange(total, device=block.device))


def plan_waves(counts: torch.Tensor, group, copies: int, waves: int) -> list[Wave]:
    """Who sends how many rows to whom in each wave, from this rank's copies per expert `counts`
    [E] (sorted by global expert id: rank r's local experts are r*L .. r*L+L-1)."""
    ep = group.size()
    num_local = counts.numel() // ep
    sent, received, on_device = _routing_table(counts, group, ep, num_local, copies)
    plan = []
    for run in cut_runs(num_local, waves):
        recv_splits = [sum(row[run.start:run.stop]) for row in received]
        block = on_device[:, run.start:run.stop]
        local_counts = torch.zeros(num_local, dtype=torch.long, device=counts.device)
        local_counts[run.start:run.stop] = block.sum(dim=0)
        plan.append(Wave([sum(row[run.start:run.stop]) for row in sent], recv_splits,
                         _arrival_order(block, sum(recv_splits)), local_counts))
    return plan


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


class _Transfer:
    """An autograd-aware all-to-all of `x` started now (as `wire_dtype`, if given) and finished by
    `result()` (in `x`'s dtype): what is computed between the two, it overlaps forward, and its
    backward overlaps the gradients' all-to-all back (the casts' backward casts the gradients)."""

    def __init__(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                 wire_dtype: torch.dtype | None):
        self.dtype = x.dtype
        self.cast = wire_dtype is not None and wire_dtype != x.dtype
        self.flight = _InFlight(output_splits, input_splits, group)
        self.in_flight = _Send.apply(x.to(wire_dtype) if self.cast else x, self.flight)

    def result(self) -> torch.Tensor:
        received = _Receive.apply(self.in_flight, self.flight)
        return received.to(self.dtype) if self.cast else received


def _by_wave(x_sorted: torch.Tensor, plan: list[Wave]) -> list[torch.Tensor]:
    """x_sorted's rows regrouped into each wave's send buffer (rank r's run w, for every r)."""
    if len(plan) == 1:
        return [x_sorted]
    pieces = torch.split(x_sorted, [w.send_splits[r] for r in range(len(plan[0].send_splits)) for w in plan])
    return [torch.cat(pieces[i::len(plan)]) for i in range(len(plan))]


def _from_waves(returned: list[torch.Tensor], plan: list[Wave]) -> torch.Tensor:
    """The inverse of `_by_wave`: each wave's returned rows back in x_sorted's order."""
    if len(plan) == 1:
        return returned[0]
    per_wave = [torch.split(rows, wave.send_splits) for rows, wave in zip(returned, plan)]
    return torch.cat([pieces[r] for r in range(len(plan[0].send_splits)) for pieces in per_wave])


def through_experts(x_sorted: torch.Tensor, counts: torch.Tensor, group,
                    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    wire_dtype: torch.dtype | None = None, waves: int = 1,
                    alongside: Callable[[], None] | None = None) -> torch.Tensor:
    """Each token copy to the rank that owns its expert, `compute(tokens, counts per local
    expert)` there, and the results back to the rows they came from, in `waves` waves.

    x_sorted [N, d] token copies sorted by global expert id, counts [E] long copies per expert.
    `alongside()` (the caller's work that needs no expert) runs while the first wave travels.
    Wave w+1's tokens travel while wave w's experts compute, and wave w's results travel back
    while wave w+1's compute; the backward mirrors it (DESIGN §5). Every expert sees the same rows
    in the same order whatever `waves` is (the same numbers, but for the grouped GEMM activation's
    1-ulp position effect, DESIGN §5); one all-to-all in flight each way.
    """
    plan = plan_waves(counts, group, x_sorted.shape[0], waves)
    sends = _by_wave(x_sorted, plan)
    going = _Transfer(sends[0], plan[0].recv_splits, plan[0].send_splits, group, wire_dtype)
    if alongside is not None:
        alongside()
    returned: list[torch.Tensor] = []
    coming: _Transfer | None = None  # the previous wave's results on their way back
    for w, wave in enumerate(plan):
        arrived = going.result()
        if w + 1 < len(plan):
            going = _Transfer(sends[w + 1], plan[w + 1].recv_splits, plan[w + 1].send_splits, group, wire_dtype)
        y = compute(arrived[wave.order], wave.local_counts)
        if coming is not None:  # they travelled during this compute
            returned.append(coming.result())
        back_in_arrival_order = torch.empty_like(y).index_copy(0, wave.order, y)
        coming = _Transfer(back_in_arrival_order, wave.send_splits, wave.recv_splits, group, wire_dtype)
    returned.append(coming.result())
    return _from_waves(returned, plan)


def _tp_input(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward all-reduces the partial input gradients of the width shards."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


class _SumOverTp(torch.autograd.Function):
    """Megatron's g: the width shards' partial sums all-reduced in forward; the gradient passed
    through in backward (every tp rank holds the same output and so already the whole gradient).
    Its output is a tensor of its own: DTensor's `full_tensor()` returns a view of its local
    tensor, and a view returned by an FSDP unit (the experts', under EP) would lose FSDP's
    pre-backward hook to any in-place op on it (FSDP2 warns of it on every rank)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(y, "sum", tp_mesh))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp_output(y: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """All-reduce the partial sums of the width shards; backward passes the gradient through."""
    return _SumOverTp.apply(y, tp_mesh)


# The waves a job's EP exchange runs in (an internal setting: 2 overlaps the first wave's compute
# with the second's transfer; more waves mean more, smaller all-to-alls).
EP_WAVES = 2


class ExpertParallel(ParallelStyle):
    """Apply to a `GroupedExperts` module with a mesh whose dims are "ep", "tp" or both; the
    tokens travel between the ep ranks as `wire_dtype` (None: in the dtype they are computed in),
    in `waves` waves of local experts (`through_experts`)."""

    def __init__(self, wire_dtype: torch.dtype | None = None, waves: int = 1):
        super().__init__()
        self.wire_dtype = wire_dtype
        self.waves = waves

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
        wire_dtype, waves = self.wire_dtype, self.waves

        def around(mod: nn.Module, forward, x_sorted: torch.Tensor, counts: torch.Tensor,
                   alongside: Callable[[], None] | None = None):
            if tp is not None:
                x_sorted = _tp_input(x_sorted, tp)
            with local_shards(mod):
                if ep_group is None:
                    out = forward(x_sorted, counts, alongside)
                else:  # the experts' forward takes no `alongside`: it runs while the tokens travel
                    out = through_experts(x_sorted, counts, ep_group, forward, wire_dtype, waves, alongside)
            if tp is not None:
                out = _tp_output(out, tp)
            return out

        wrap_forward(module, around, prefix="ExpertParallel")
        return module
