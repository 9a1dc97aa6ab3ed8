"""Initialise a sharded model with exactly the values one process would draw.

After TP/EP/FSDP every parameter is a DTensor holding only this rank's shard. Running the model's
own `init_weights()` on it as is would fill each shard from this rank's generator, so the
distributed model would start from different weights than the single-process one (and on the CPU
DTensor has no offset-aware generator at all). Here each random fill (`uniform_`, `normal_`, ...)
on a DTensor draws the full-size tensor from the ordinary generator, exactly as one process does,
and keeps this rank's shard; every other op of the init (comparisons, scaling, clamping, fills)
runs on the DTensor as usual, and a value the init branches on is read globally. Every rank
draws every tensor in the same order, so all ranks and the single process consume the generator
identically.

Memory: one full parameter exists at a time (the largest, e.g. the stacked experts of one layer),
never the whole model.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

RANDOM_FILLS = {
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
}
# Python-side reads of a tensor's value: a DTensor answers them from its local shard (a Partial
# `mask.any()` is this rank's partial answer), but the init's control flow (trunc_normal_ redraws
# until no value is out of range) must follow the global value, as in one process.
VALUE_READS = {torch.Tensor.__bool__, torch.Tensor.item}


class FullTensorRandomFills(TorchFunctionMode):
    """While active, random fills of DTensors draw the full tensor and keep the local shard."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_FILLS and args and isinstance(args[0], DTensor):
            target: DTensor = args[0]
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            func(full, *args[1:], **kwargs)
            mesh = target.device_mesh
            # Replicate -> any sharding is a local slice, no communication.
            shard = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
            target.to_local().copy_(shard.redistribute(mesh, target.placements).to_local())
            return target
        if func in VALUE_READS and isinstance(args[0], DTensor):
            return func(args[0].full_tensor(), *args[1:], **kwargs)
        return func(*args, **kwargs)


def init_weights_like_one_process(model: torch.nn.Module) -> None:
    """`model.init_weights()` on a parallelised model, giving the single-process values."""
    with torch.no_grad(), FullTensorRandomFills():
        model.init_weights()
