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

On CPUs (gloo) every unit's reduce-scatter is `gloo_reduce_scatter.AllToAllReduceScatter`: an
all-to-all of the shards and a local sum, which sends half of what gloo's own (an all-reduce)
does and, on two ranks, is bitwise the same sum.

Resharding (`parallel.reshard_after_forward`, default true; `parallel/reshard_policy.py`): a block
is all-gathered for its forward, freed, and gathered again for its backward (ZeRO-3), unless the
policy keeps it gathered from its forward to its backward: the last block (its backward follows
its forward at once: torchtitan's rule), and the blocks below it while their unsharded weights fit
in `parallel.keep_gathered_gib` (default 1 GiB: every block of a small model, few or none of a
large one). False keeps every block (ZeRO-2's traffic: no all-gather in backward, half the
blocks' all-gather bytes) for the whole unsharded model's parameters alive at the end of the
forward.

Overlap on CPUs. FSDP2 overlaps its collectives with compute through CUDA streams; a CPU job has
none, so every collective blocked the thread that computes. Two settings put them on gloo's own
threads instead, with the same collectives and the same numbers:

- `parallel.overlap_reduce_scatter`: a backward's reduce-scatters are started and left
  travelling while the next unit's backward computes (`AllToAllReduceScatter.overlapping`), and
  `finish_reductions` completes them when the backward is over. Only where nothing reads a reduced
  gradient before then: not under HSDP (FSDP all-reduces the reduce-scatter's output at once) and
  not in a micro-batch that adds to the gradients of an earlier one (`overlap_reductions`).
- `parallel.prefetch_all_gather`: each block's all-gather is issued asynchronously while the block
  before it computes (in backward, the block after it), FSDP2's explicit prefetch; and the next
  forward's first all-gather (the root unit's, final norm and head; and the embedding's where it
  gathers the whole table, under TP), which nothing computes beside, is issued in the optimizer
  step as soon as those parameters are final (once Muon's AdamW part is done and its exchange's
  pieces have left, `prefetch_next_forward`): it travels while Muon's Newton-Schulz runs (with
  another optimizer it is issued after its step). Only
  those units: a block's matrices are Muon's, final only at its end. The next forward (or a
  validation pass) waits for it in FSDP's pre-forward; a checkpoint load first discards it
  (`discard_next_forward`). Holds those units unsharded through Muon's part.

With `parallel.overlap_reduce_scatter`, the root unit's reduce-scatter starts as soon as its
gradients are final, near the backward's start (`reduce_root_at_its_last_gradient`), not in
FSDP's final callback. With either setting and EP, a backward's FSDP traffic waits for each EP
block's expert exchange (`parallel/backward_traffic.py`). On any CPU job without TP the
embedding's all-gather fetches only the rows its forward reads (`parallel/embedding_gather.py`, in
the embedding's pre-forward: it needs the token ids) and its reduce-scatter sends only its touched
rows (`parallel/embedding_rows.py`).

Gradients in bf16 on the wire (`parallel.reduce_wire_dtype = "bf16"`, off by default): half the
bytes of every reduce-scatter and of HSDP's all-reduce, for the rounding of each rank's gradient
to bf16. On CPUs the all-to-all reduce-scatter casts what it sends and sums what it receives in
fp32 (the fp32 sum of the bf16-rounded shards, overlapped or not); under HSDP FSDP's policy casts
the gradients to bf16 instead, so that its all-reduce across replicas sends bf16 too: the shard
group's fp32 sum is rounded to bf16 for it, and gloo sums the replicas' in bf16. On GPUs FSDP's
policy reduces in bf16 and NCCL sums in bf16 (`mixed_precision_policy`).
"""

from __future__ import annotations

from typing import Callable
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor, Shard

from trinity_train.config import ParallelConfig
from trinity_train.parallel.backward_traffic import BackwardTraffic, hold_backward_traffic
from trinity_train.parallel.embedding_gather import read_rows_only
from trinity_train.parallel.embedding_rows import TouchedRowsReduceScatter
from trinity_train.parallel.gloo_reduce_scatter import AllToAllReduceScatter
from trinity_train.parallel.mesh import ParallelDims, expert_shard_dim
from trinity_train.parallel.reshard_policy import gathered_numel, kept_gathered
from trinity_train.parallel.wire_precision import wire_dtype

# The model's one reduce-scatter object on a CPU job, which the step tells when it may overlap.
_REDUCE_SCATTERS: WeakKeyDictionary[nn.Module, AllToAllReduceScatter] = WeakKeyDictionary()
# The units whose all-gathers `prefetch_next_forward` issues (a CPU job with prefetch on), and the
# handles of the ones issued and not yet discarded.
_NEXT_FORWARD: WeakKeyDictionary[nn.Module, tuple[list[FSDPModule], list]] = WeakKeyDictionary()


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
    all-to-all reduce-scatter sends bf16 itself and lands an fp32 sum (`gloo_reduce_scatter`)."""
    param_dtype = torch.bfloat16 if device.type == "cuda" and dtype == "bf16" else None
    if reduce_wire_dtype == "bf16" and (device.type != "cpu" or hsdp):
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
    if param_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dims: ParallelDims, device: torch.device, dtype: str,
               parallel: ParallelConfig) -> None:
    """Shard a TrinityModel (after TP/EP, before its weights are materialised) for a job on
    `device` computing in `dtype` (`train.dtype`; a CPU job's collectives run on gloo), with the
    overlap `parallel` asks for."""
    mesh = dims.fsdp_mesh
    mp_policy = mixed_precision_policy(device, dtype, parallel.reduce_wire_dtype, dims.dp_replicate > 1)
    placement = expert_placement(dims.efsdp)
    fully_shard(model.embed, mesh=mesh, mp_policy=mp_policy)
    # The embedding's backward reads only the token ids, never its weight: no all-gather for it.
    model.embed.set_unshard_in_backward(False)
    kept = kept_gathered([_gathered_bytes(block, dims, mp_policy) for block in model.layers],
                         parallel.keep_gathered_gib)
    for block, keep in zip(model.layers, kept):
        block_placement = None
        reshard = not keep
        if block.is_moe and dims.ep > 1:
            fully_shard(block.mlp.experts, mesh=dims.expert_fsdp_mesh, mp_policy=mp_policy,
                        shard_placement_fn=placement, reshard_after_forward=reshard)
        elif block.is_moe:  # the experts are in the block's unit, sharded over dp_shard (= efsdp)
            block_placement = _for_params(block.mlp.experts.parameters(), placement)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, shard_placement_fn=block_placement,
                    reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    reduce_scatter = AllToAllReduceScatter(wire_dtype(parallel.reduce_wire_dtype))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: no pre-multiplied sum, which gloo lacks and a factor of 1 does not need.
            module.set_force_sum_reduction_for_comms(True)
            if device.type == "cpu":  # gloo: its own is an all-reduce, twice the share's bytes
                module.set_custom_reduce_scatter(reduce_scatter)
    if device.type == "cpu":
        rows = dims.tp == 1  # (a vocabulary-parallel table is a DTensor of TP's)
        if rows:
            model.embed.set_custom_reduce_scatter(
                TouchedRowsReduceScatter(model.embed.embedding_dim, wire_dtype(parallel.reduce_wire_dtype)))
            read_rows_only(model.embed)
        expert_blocks = [i for i, block in enumerate(model.layers) if block.is_moe and dims.ep > 1]
        overlap = dims.dp_replicate == 1
        if expert_blocks:
            traffic = BackwardTraffic()
            hold_backward_traffic(model, expert_blocks, traffic, _units_of)
            reduce_scatter.run_or_hold = traffic.run_or_hold
        if overlap:
            _REDUCE_SCATTERS[model] = reduce_scatter
            reduce_root_at_its_last_gradient(model, reduce_scatter)
        if True:
            prefetch_neighbouring_blocks(model, held=set(expert_blocks))
            # (the embedding's rows are gathered in its own pre-forward, once the ids are known)
            _NEXT_FORWARD[model] = ([model] if rows else [model, model.embed], [])


def reduce_root_at_its_last_gradient(model: FSDPModule, reduce_scatter: AllToAllReduceScatter) -> None:
    """Start the root unit's reduce-scatter as soon as its gradients are final, near the start of
    the backward, instead of at its end. The root unit (final norm and head) has no module whose
    backward ends after everything else's; FSDP2 registers its post-backward on the root's forward
    inputs, the token ids, which take no gradient, so it runs in the backward's final callback and
    its reduce-scatter (the head's, as large as the embedding's) travels while nothing computes.
    The head's gradient is accumulated when the backward starts (the fused loss computed it in the
    forward) and the final norm's right after; once every root parameter's gradient is accumulated
    (a post-accumulate-grad hook on each gathered parameter), this runs FSDP's own post-backward of
    the root's parameter group (its reshard and its `foreach_reduce`), which then leaves the
    reduce-scatter travelling while the blocks' backward computes; the final callback skips a
    group already past it. Only in a backward whose reduce-scatters overlap (`overlapping`); the
    same sums, earlier."""
    group = model._get_fsdp_state()._fsdp_param_group
    hooked: set[int] = set()
    accumulated: set[int] = set()

    def on_accumulated(param: torch.Tensor) -> None:
        accumulated.add(id(param))
        if (reduce_scatter.overlapping and len(accumulated) == len(hooked)
                and group._training_state != TrainingState.POST_BACKWARD):
            group.post_backward()

    def before_forward(module, args) -> None:
        accumulated.clear()
        for fsdp_param in group.fsdp_params:  # gathered by FSDP's own pre-forward, registered first
            param = fsdp_param.unsharded_param
            if param.requires_grad and id(param) not in hooked:
                param.register_post_accumulate_grad_hook(on_accumulated)
                hooked.add(id(param))

    model.register_forward_pre_hook(before_forward)


def _gathered_bytes(block: nn.Module, dims: ParallelDims, mp_policy: MixedPrecisionPolicy) -> int:
    """A block's FSDP units gathered on a rank (padded, in the gathered dtype): what the reshard
    policy weighs, as the planner counts it. Its routed experts are gathered over efsdp ranks."""
    experts = {id(p) for p in block.mlp.experts.parameters()} if block.is_moe else set()
    numel = sum(gathered_numel((p.to_local() if isinstance(p, DTensor) else p).shape,
                               dims.efsdp if id(p) in experts else dims.fsdp_shards, id(p) in experts)
                for p in block.parameters())
    return numel * (mp_policy.param_dtype or torch.float32).itemsize


def _units_of(block: nn.Module) -> list[FSDPModule]:
    """A block's FSDP units: the block, and its routed experts when they are their own (EP)."""
    return [m for m in (block, getattr(getattr(block, "mlp", None), "experts", None)) if isinstance(m, FSDPModule)]


def prefetch_neighbouring_blocks(model: nn.Module, held: set[int] = frozenset()) -> None:
    """Issue each block's all-gather while the block before it computes (in backward: the block
    after it), asynchronously on gloo's threads; FSDP waits for it in the block's pre-forward
    (pre-backward). The same all-gathers, earlier. The blocks in `held` prefetch the block below
    them in backward through `BackwardTraffic` (after their expert exchange), not FSDP."""
    blocks = list(model.layers)
    model._set_unshard_async_op(True)  # every unit's own unshard asynchronous too, waited at use
    model.embed.set_modules_to_forward_prefetch(_units_of(blocks[0]))
    model.set_modules_to_backward_prefetch(_units_of(blocks[-1]))  # the root's backward (head, norm) comes first
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(_units_of(blocks[i + 1]))
        if i > 0 and i not in held:
            block.set_modules_to_backward_prefetch(_units_of(blocks[i - 1]))


def prefetch_next_forward(model: nn.Module) -> None:
    """Issue the next forward's first all-gathers (the root unit's, and the embedding's under TP) now, on
    gloo's threads: call once their parameters are final for the step. The forward waits for them
    in FSDP's pre-forward hooks. A no-op without `parallel.prefetch_all_gather` or off a CPU job."""
    if model in _NEXT_FORWARD:
        units, handles = _NEXT_FORWARD[model]
        handles[:] = [unit.unshard(async_op=True) for unit in units]


def discard_next_forward(model: nn.Module) -> None:
    """Before parameters change other than by the optimizer (a checkpoint load): wait for the
    all-gathers `prefetch_next_forward` issued and free what they gathered, so that the next
    forward gathers the new values. A no-op when none is pending."""
    if model in _NEXT_FORWARD:
        units, handles = _NEXT_FORWARD[model]
        for handle in handles:
            handle.wait()  # a no-op for one a forward already waited for
        if handles:
            for unit in units:
                unit.reshard()
        handles.clear()


def overlap_reductions(model: nn.Module, fresh: bool) -> None:
    """Whether this backward's reduce-scatters may travel while the backward goes on: only when
    `fresh`, i.e. no gradient from an earlier micro-batch is waiting to be added to (FSDP adds the
    reduced shard at once). A no-op without `parallel.overlap_reduce_scatter` or off a CPU job."""
    if model in _REDUCE_SCATTERS:
        _REDUCE_SCATTERS[model].overlapping = fresh


def finish_reductions(model: nn.Module) -> None:
    """Complete the reduce-scatters a backward left travelling: its gradients are then final."""
    if model in _REDUCE_SCATTERS:
        _REDUCE_SCATTERS[model].finish()


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
