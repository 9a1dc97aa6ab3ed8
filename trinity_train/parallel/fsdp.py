"""FSDP2 (`fully_shard`) over the data-parallel ranks; HSDP when `dp_replicate > 1`.

One FSDP unit per decoder block and one for the embedding; the root unit holds the final norm and
the head, which stay gathered through the forward because the chunked loss calls the head once per
chunk. Routed experts that expert parallelism already splits over `ep` are their own unit, sharded
over the remaining data-parallel ranks (`efsdp`, and replicated over `dp_replicate`).

Gradients are summed, not averaged, over the data-parallel ranks (divide factor 1): the loss of
each rank must be its summed token loss divided by the global token count. That one rule is right
for every parameter, whatever subset of ranks its gradient is reduced over (experts see the tokens
of their whole ep group, other weights only the local ones).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trinity_train.parallel.mesh import ParallelDims


def mixed_precision_policy(device: torch.device, dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPUs when `train.dtype = "bf16"`; fp32
    otherwise (the CPU has no fast bf16 path). Sharded master weights are always fp32."""
    if device.type == "cuda" and dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dims: ParallelDims, mp_policy: MixedPrecisionPolicy) -> None:
    """Shard a TrinityModel (after TP/EP, before its weights are materialised)."""
    mesh = dims.fsdp_mesh
    fully_shard(model.embed, mesh=mesh, mp_policy=mp_policy)
    for block in model.layers:
        if dims.ep > 1 and block.is_moe:
            fully_shard(block.mlp.experts, mesh=dims.expert_fsdp_mesh, mp_policy=mp_policy)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: no pre-multiplied sum, which gloo lacks and a factor of 1 does not need.
            module.set_force_sum_reduction_for_comms(True)
