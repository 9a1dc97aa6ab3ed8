"""FSDP2 (`fully_shard`) over the data-parallel ranks; HSDP when `dp_replicate > 1`.

One FSDP unit per decoder block and one for the embedding; the root unit holds the final norm and
the head, which stay gathered through the forward because the chunked loss calls the head once per
chunk. Routed experts that expert parallelism already splits over `ep` are their own unit, sharded
over the remaining data-parallel ranks (`efsdp`, and replicated over `dp_replicate`).

Routed-expert weights (`[E, I, d]` gate/up, `[E, d, I]` down; this rank's whole experts after
EP) are sharded along the expert dim 0 when this rank's experts split evenly over the FSDP ranks,
and along dim 1 (I of gate/up, d of down) otherwise, when dim 1 does (`mesh.expert_shard_dim`):
FSDP's default dim 0 would pad an uneven split, e.g. 32 local experts over efsdp=64 ranks leave
half the ranks holding a padded slice of nothing, and every all-gather and reduce-scatter moves 64
slices for 32 real ones (torchtitan shards dim 1 for the same reason). The same rule applies
without EP, where the experts sit in their block's unit, sharded over `dp_shard` (= efsdp).

Gradients are summed, not averaged, over the data-parallel ranks (divide factor 1): the loss of
each rank must be its summed token loss divided by the global token count. That one rule is right
for every parameter, whatever subset of ranks its gradient is reduced over (experts see the tokens
of their whole ep group, other weights only the local ones).

A CPU job's collectives and overlaps (gloo has no reduce-scatter of its own and no streams) are
installed on top of this by `parallel/gloo` (`install_gloo_communication`), with the same sums.

Resharding (`parallel.keep_gathered_gib`; `parallel/reshard_policy.py`): a block is
all-gathered for its forward, freed, and gathered again for its backward (ZeRO-3), unless the
policy keeps it gathered from its forward to its backward: the last block (its backward follows
its forward at once: torchtitan's rule), and the blocks below it while their unsharded weights fit
in `parallel.keep_gathered_gib` (default 1 GiB: every block of a small model, few or none of a
large one; inf keeps every block: ZeRO-2's traffic, no all-gather in backward, for the whole
unsharded model's parameters alive at the end of the forward).

Experts gathered once a step (`parallel.expert_gather = "step"`): each MoE block's routed experts
are their own unit (also without EP, sharded over the same dp_shard x cp ranks), never resharded
after their forward, and, in every micro-batch but the last, neither resharded after their
backward nor reduced: FSDP sums their unsharded gradients (in the reduce dtype) over the
micro-batches and the last backward reduce-scatters the sum and reshards them (FSDP2's
`set_reshard_after_backward` / `set_requires_gradient_sync`, its recipe in pytorch PR #124319;
Megatron's distributed optimizer and ZeRO-1 move the same bytes over the expert-data-parallel
group). One all-gather and one reduce-scatter of the experts a step instead of one each (and a
second all-gather in backward) per micro-batch, for every MoE layer's experts and their fp32
gradients alive through the step (`gather_experts_once`, called by the step; the planner prices
both). The reshard policy then weighs each block without its experts, which stay gathered anyway.

Gradients in bf16 on the wire (`parallel.reduce_wire_dtype = "bf16"`, off by default): half the
bytes of every reduce-scatter and of HSDP's all-reduce, for the rounding of each rank's gradient
to bf16. On CPUs gloo's all-to-all reduce-scatter (`parallel/gloo`) casts what it sends and sums what it
receives in fp32 (the fp32 sum of the bf16-rounded shards, overlapped or not); under HSDP FSDP's policy casts
the gradients to bf16 instead, so that its all-reduce across replicas sends bf16 too: the shard
group's fp32 sum is rounded to bf16 for it, and gloo sums the replicas' in bf16. On GPUs FSDP's
policy reduces in bf16 and NCCL sums in bf16 (`mixed_precision_policy`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from trinity_train.config import ParallelConfig
from trinity_train.model.moe import GroupedExperts
from trinity_train.parallel.mesh import ParallelDims, expert_shard_dim
from trinity_train.parallel.reshard_policy import gathered_numel, kept_gathered


def expert_placement(efsdp: int) -> Callable[[nn.Parameter], Shard]:
    """`fully_shard`'s `shard_placement_fn` for routed-expert weights sharded over `efsdp` ranks,
    each weight judged by its local (post-EP/TP) shape."""

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(local.shape[0], efsdp, local.shape[1]))

    return placement


def _for_params(params, placement: Callable[[nn.Parameter], Shard]
                ) -> Callable[[nn.Parameter], Shard | None]:
    """`placement` for `params`, FSDP's default (dim 0) for any other parameter of the unit."""
    ids = {id(p) for p in params}
    return lambda p: placement(p) if id(p) in ids else None


def mixed_precision_policy(device: torch.device, dtype: str, reduce_wire_dtype: str = "full",
                           hsdp: bool = False) -> MixedPrecisionPolicy:
    """bf16 compute on GPUs when `train.dtype = "bf16"`; fp32 otherwise (the CPU has no fast bf16
    path). Sharded master weights are always fp32. Gradients are reduced in fp32, or in bf16 under
    `parallel.reduce_wire_dtype = "bf16"` where the backend's own collective must carry bf16:
    NCCL's reduce-scatter, and HSDP's all-reduce across replicas on any backend (FSDP runs it on
    the reduce-scatter's output, in the reduce dtype). A CPU job without HSDP keeps fp32 here: its
    all-to-all reduce-scatter sends bf16 itself and lands an fp32 sum (`parallel/gloo`)."""
    param_dtype = torch.bfloat16 if device.type == "cuda" and dtype == "bf16" else None
    if reduce_wire_dtype == "bf16" and (device.type != "cpu" or hsdp):
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
    if param_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dims: ParallelDims, device: torch.device, dtype: str,
               parallel: ParallelConfig) -> None:
    """Shard a TrinityModel (after TP/EP, before its weights are materialised) for a job on
    `device` computing in `dtype` (`train.dtype`), as `parallel` asks (the reshard policy, the
    gradients' wire dtype)."""
    mesh = dims.fsdp_mesh
    mp_policy = mixed_precision_policy(device, dtype, parallel.reduce_wire_dtype, dims.dp_replicate > 1)
    placement = expert_placement(dims.efsdp)
    fully_shard(model.embed, mesh=mesh, mp_policy=mp_policy)
    # The embedding's backward reads only the token ids, never its weight: no all-gather for it.
    model.embed.set_unshard_in_backward(False)
    experts_once = parallel.expert_gather == "step"
    kept = kept_gathered([_gathered_bytes(block, dims, mp_policy, with_experts=not experts_once)
                          for block in model.layers], parallel.keep_gathered_gib)
    for block, keep in zip(model.layers, kept):
        block_placement = None
        reshard = not keep
        if block.is_moe and (dims.ep > 1 or experts_once):
            fully_shard(block.mlp.experts, mesh=dims.expert_fsdp_mesh, mp_policy=mp_policy,
                        shard_placement_fn=placement, reshard_after_forward=reshard and not experts_once)
        elif block.is_moe:  # the experts are in the block's unit, sharded over dp_shard (= efsdp)
            block_placement = _for_params(block.mlp.experts.parameters(), placement)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, shard_placement_fn=block_placement,
                    reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: no pre-multiplied sum, which gloo lacks and a factor of 1 does not need.
            module.set_force_sum_reduction_for_comms(True)


def _gathered_bytes(block: nn.Module, dims: ParallelDims, mp_policy: MixedPrecisionPolicy,
                    with_experts: bool = True) -> int:
    """A block's FSDP units gathered on a rank (padded, in the gathered dtype): what the reshard
    policy weighs, as the planner counts it. Its routed experts are gathered over efsdp ranks
    (left out when `with_experts` is false: gathered once a step, whatever the policy says)."""
    experts = {id(p) for p in block.mlp.experts.parameters()} if block.is_moe else set()
    numel = sum(gathered_numel((p.to_local() if isinstance(p, DTensor) else p).shape,
                               dims.efsdp if id(p) in experts else dims.fsdp_shards, id(p) in experts)
                for p in block.parameters() if with_experts or id(p) not in experts)
    return numel * (mp_policy.param_dtype or torch.float32).itemsize


def all_reduce_across_replicas(model: nn.Module, now: bool) -> None:
    """HSDP: whether this backward all-reduces the gradients across replica groups. The step turns
    it off for every micro-batch but the last: each still reduce-scatters inside its shard group,
    FSDP keeps the partial sums, and the last micro-batch's all-reduce carries all of them, so the
    traffic across nodes is one all-reduce per step instead of one per micro-batch (FSDP2's
    `set_requires_all_reduce`). A no-op without FSDP."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(now)


def reduce_gradients(model: nn.Module, now: bool) -> None:
    """Whether this backward reduces the gradients at all (`parallel.sync_every_micro_batch =
    false`): the step turns it off for every micro-batch but the last, so each FSDP unit keeps
    its unsharded gradients, summed over the micro-batches, and reduce-scatters them once a step
    (and under HSDP all-reduces them once across replicas): one reduce-scatter a step instead of
    one per micro-batch, for a rank holding every unit's whole gradients until the last backward
    (FSDP2's `set_requires_gradient_sync`). A no-op without FSDP."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(now)


def expert_units(model: nn.Module) -> list[FSDPModule]:
    """The routed experts' own FSDP units of `model` (under EP, or gathered once a step)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts) and isinstance(m, FSDPModule)]


def gather_experts_once(units: list[FSDPModule], last_micro_batch: bool) -> None:
    """`parallel.expert_gather = "step"`: before each micro-batch, whether the routed experts'
    `units` (`expert_units`) reshard after this backward and reduce its gradients: only in the
    step's last one, so that they stay gathered, and their gradients summed unsharded, from the
    first micro-batch's forward to the last one's backward (see the module)."""
    for unit in units:
        unit.set_reshard_after_backward(last_micro_batch, recurse=False)
        unit.set_requires_gradient_sync(last_micro_batch, recurse=False)
