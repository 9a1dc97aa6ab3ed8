"""The global scalars of a step: summed losses and counts, and the gradient norm.

One code path for one process and for N ranks: with `ParallelDims.one_process()` (no mesh) the
sums are the identity and the gradients are plain tensors.

Data-parallel ranks see different tokens, and so do the context-parallel ranks that split each
row, so loss sums, token counts and tokens-per-expert are summed over dp x cp (the `token_mesh`);
tensor-parallel ranks see the same tokens and hold the same
values, so they are not summed again. The gradient norm is computed from DTensor gradients, which
know how each one is split: a gradient sharded by FSDP, TP and EP, or replicated over some ranks,
contributes its squared norm exactly once (expert gradients are not counted once per ep rank).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trinity_train.parallel.mesh import ParallelDims


def sum_over_data_parallel(tensor: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum `tensor` over the data- and context-parallel ranks (dp x cp), in place (and return it);
    a no-op on one rank."""
    work = start_sum_over_data_parallel(tensor, dims)
    if work is not None:
        work.wait()
    return tensor


def start_sum_over_data_parallel(tensor: torch.Tensor, dims: ParallelDims) -> dist.Work | None:
    """`sum_over_data_parallel`, started: `tensor` holds the sum once the returned work is
    waited (None: nothing to wait for, on one rank). For a sum not read at once, so that it
    travels while the rank computes."""
    if dims.mesh is not None and dims.dp * dims.cp > 1:
        return dist.all_reduce(tensor, group=dims.token_mesh.get_group(), async_op=True)
    return None


def sum_over_context(tensor: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum `tensor` over the context-parallel ranks that split the same rows, in place (and return
    it); a no-op without context parallelism."""
    if dims.mesh is not None and dims.cp > 1:
        dist.all_reduce(tensor, group=dims.cp_mesh.get_group())
    return tensor


def max_over_data_parallel(tensor: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The elementwise maximum of `tensor` over the data- and context-parallel ranks (dp x cp), in
    place (and return it); a no-op on one rank."""
    if dims.mesh is not None and dims.dp * dims.cp > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dims.token_mesh.get_group())
    return tensor


def _params_by_mesh(parameters: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters with a gradient, grouped by the mesh it lives on (None for plain tensors):
    DTensor ops, the foreach ones included, only combine tensors of one mesh."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    return list(groups.values())


def _global_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    norms = []
    for params in groups:  # one reduction per mesh
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    if not norms:
        return torch.zeros(())
    if len(norms) == 1:  # one process, or a single mesh: torch's norm as it is
        return norms[0]
    return torch.stack(norms).square().sum().sqrt()


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients as one vector, the same on every rank (fp32 scalar)."""
    return _global_norm(_params_by_mesh(parameters))


def clip_grads_with_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor) -> None:
    """Scale the gradients by `max_norm / total_norm` where that is below 1 (torch's
    `clip_grads_with_norm_`, applied one mesh at a time)."""
    for params in _params_by_mesh(parameters):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)

