"""Make a TrinityModel distributed: the construction order of DESIGN §4.

build on the meta device -> tensor parallel -> expert parallel -> activation checkpointing and
compile (`apply_training_wrappers`) -> FSDP/HSDP -> materialise on the device -> `init_weights()`
shard by shard with the values one process would draw. (A CPU job's gloo collectives are
installed after, with the optimizer: `parallel/gloo`.) A model never exists whole on one rank; one
process takes the same path without the parallel steps, so single- and multi-process runs start
from identical weights for the same seed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from trinity_train.config import Config, ParallelConfig
from trinity_train.model import TrinityModel, build_model
from trinity_train.parallel.expert_parallel import EP_WAVES, ExpertParallel
from trinity_train.parallel.fsdp import apply_fsdp
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.sharded_init import init_weights_like_one_process
from trinity_train.parallel.tensor_parallel import apply_tensor_parallel
from trinity_train.parallel.wire_precision import wire_dtype


def apply_training_wrappers(model: nn.Module, cfg: Config) -> nn.Module:
    """Activation checkpointing, then compilation, per block (DESIGN §4 order), in place: the
    parameter names seen by checkpoints are unchanged."""
    if cfg.train.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    return model


def split_model(model: TrinityModel, dims: ParallelDims, parallel: ParallelConfig | None = None) -> TrinityModel:
    """Tensor and expert parallelism, in place, on a model built on the meta device; the EP
    all-to-alls go as `parallel` says (`ep_wire_dtype`; None: the defaults), in `EP_WAVES` waves."""
    parallel = parallel or ParallelConfig()
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh)
    expert_mesh = dims.expert_mesh
    if expert_mesh is not None:
        for moe in model.moe_layers:
            parallelize_module(moe.experts, expert_mesh, ExpertParallel(wire_dtype(parallel.ep_wire_dtype), EP_WAVES))
    return model


def build_parallel_model(cfg: Config, dims: ParallelDims, device: torch.device) -> TrinityModel:
    """Build, parallelise, wrap, materialise and initialise (seeded with `train.seed`) the model."""
    model = build_model(cfg.model, device="meta")
    if dims.is_distributed:
        split_model(model, dims, cfg.parallel)
    model = apply_training_wrappers(model, cfg)
    if dims.is_distributed:
        apply_fsdp(model, dims, device, cfg.train.dtype, cfg.parallel)
    model.to_empty(device=device)
    torch.manual_seed(cfg.train.seed)
    init_weights_like_one_process(model)
    return model
