"""Make a TrinityModel distributed: the construction order of DESIGN §4.

build on the meta device -> tensor parallel -> expert parallel -> FSDP/HSDP -> materialise on the
device -> `init_weights()` shard by shard with the values one process would draw. A model never
exists whole on one rank; one process (world size 1) takes the same path without the middle steps,
so single- and multi-process runs start from identical weights for the same seed.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import parallelize_module

from trinity_train.config import Config
from trinity_train.model import TrinityModel, build_model
from trinity_train.parallel.expert_parallel import ExpertParallel
from trinity_train.parallel.fsdp import apply_fsdp, mixed_precision_policy
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.sharded_init import init_weights_like_one_process
from trinity_train.parallel.tensor_parallel import apply_tensor_parallel


def parallelize_model(model: TrinityModel, dims: ParallelDims, cfg: Config,
                      device: torch.device) -> TrinityModel:
    """Apply TP, EP and FSDP to a model built on the meta device (in place; returns it)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh)
    expert_mesh = dims.expert_mesh
    if expert_mesh is not None:
        for moe in model.moe_layers:
            parallelize_module(moe.experts, expert_mesh, ExpertParallel())
    apply_fsdp(model, dims, mixed_precision_policy(device, cfg.train.dtype))
    return model


def build_parallel_model(cfg: Config, dims: ParallelDims, device: torch.device) -> TrinityModel:
    """Build, parallelise, materialise and initialise (seeded with `train.seed`) the model."""
    model = build_model(cfg.model, device="meta")
    if dims.is_distributed:
        parallelize_model(model, dims, cfg, device)
    model.to_empty(device=device)
    torch.manual_seed(cfg.train.seed)
    init_weights_like_one_process(model)
    return model
