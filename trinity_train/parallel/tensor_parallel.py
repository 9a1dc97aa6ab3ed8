"""Tensor parallelism for TrinityModel with DTensor ParallelStyles (DESIGN §4).

Between sublayers the residual stream is a DTensor split along the sequence (`Shard(1)`), so the
norms run sequence-parallel on 1/tp of the tokens. Each sublayer gathers the sequence, splits its
work over the tp ranks and gives back a sequence shard:

- attention: q/k/v/gate projections by output columns (whole heads per rank), QK-norm on the local
  heads, o_proj by input rows with a reduce-scatter back to sequence shards;
- dense FFN: gate/up by columns, down by rows, reduce-scatter back to sequence shards;
- MoE: the router runs replicated on the whole sequence (every tp rank routes the same tokens the
  same way, so expert-bias counts agree); the shared expert is split like the dense FFN and its
  output all-reduced; routed experts are split by `ExpertParallel` (their width over tp);
- embedding by vocabulary rows (reduce-scatter into sequence shards), final norm sequence-parallel
  then gathered, and the head by vocabulary columns with the logits gathered, so the model's
  chunked cross entropy runs unchanged on whole rows.

The gradients of the replicated pieces come out right by construction: whatever a rank computes
from a shard is a partial sum that the DTensor layouts reduce (Megatron's f/g operators).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from trinity_train.model.moe import FeedForward, MoE
from trinity_train.parallel.local_shards import local_shards, wrap_forward

SEQUENCE = Shard(1)  # [B, T, d]: the residual stream between sublayers


class WidthShardedNorm(ParallelStyle):
    """A norm over the FFN width, which tp splits (NormFormer's mid-FFN LayerNorm): gather the
    width, normalise with replicated parameters, keep this rank's slice."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_mod, inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, [Shard(-1)], run_check=False).redistribute(
                mesh, [Replicate()])

        def scatter(_mod, output, mesh):
            return output.redistribute(mesh, [Shard(-1)]).to_local()

        return distribute_module(module, device_mesh, input_fn=gather, output_fn=scatter)


class ShardedHeadScale(ParallelStyle):
    """NormFormer's per-head scale `[num_heads]` split like the heads; the attention code, which
    multiplies it into its local heads, sees the local slice."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_parameter("head_scale", nn.Parameter(distribute_tensor(
            module.head_scale.data, device_mesh, [Shard(0)], src_data_rank=None)))

        def around(mod, forward, *args, **kwargs):
            with local_shards(mod):
                return forward(*args, **kwargs)

        wrap_forward(module, around, prefix="HeadSharded")
        return module


def _feed_forward_plan(prefix: str, output: Shard | Replicate) -> dict[str, ParallelStyle]:
    """gate/up by columns, down by rows; `output` is the layout the result leaves in."""
    return {
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(output_layouts=output,
                                               use_local_output=isinstance(output, Replicate)),
    }


def _block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "attn_norm": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        # Gather the sequence once per sublayer; the projections share the gathered input, so
        # their input gradients are summed before the single reduce-scatter.
        "attn": PrepareModuleInput(input_layouts=(SEQUENCE, None, None),
                                   desired_input_layouts=(Replicate(), None, None)),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.gate_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False),
        # QK-norm over head_dim of the local heads [B, T, heads/tp, head_dim]: its gain is
        # replicated and its gradient summed over the heads of every rank.
        "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    for name in ("attn_post_norm", "mlp_post_norm"):
        if getattr(block, name) is not None:
            plan[name] = SequenceParallel()

    mlp = block.mlp
    if isinstance(mlp, MoE):
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(), None), desired_output_layouts=(SEQUENCE, None),
            use_local_output=False)
        if mlp.shared_expert is not None:
            # The MoE body runs on plain tensors (router, sorting, the grouped GEMM); the shared
            # expert takes them as replicated DTensors, so gate and up sum their partial input
            # gradients before one all-reduce, and its output is all-reduced back to plain.
            plan["mlp.shared_expert"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Replicate(),))
            plan.update(_feed_forward_plan("mlp.shared_expert", Replicate()))
            if mlp.shared_expert.mid_norm is not None:
                plan["mlp.shared_expert.mid_norm"] = WidthShardedNorm()
    else:
        assert isinstance(mlp, FeedForward)
        plan["mlp"] = PrepareModuleInput(input_layouts=(SEQUENCE,),
                                         desired_input_layouts=(Replicate(),))
        plan.update(_feed_forward_plan("mlp", SEQUENCE))
        if mlp.mid_norm is not None:
            plan["mlp.mid_norm"] = WidthShardedNorm()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model` (a TrinityModel, on any device incl. meta) over the 1-D `tp_mesh`."""
    # The vocabulary-split head is a DTensor that only works called as a module: no fused loss.
    model.fused_loss = False
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQUENCE,
                                 use_local_output=False),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    # The chunked loss slices whole rows of the final hidden states: gather the sequence.
    parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(
        output_layouts=SEQUENCE, desired_output_layouts=Replicate(), use_local_output=True))
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(block))
        if block.attn.head_scale is not None:
            parallelize_module(block.attn, tp_mesh, ShardedHeadScale())
