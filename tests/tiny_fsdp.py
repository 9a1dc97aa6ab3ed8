"""The tiny model under FSDP over two gloo ranks: what the FSDP tests build in each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import TINY_MODEL
from trinity_harness.ranks import init_gloo
from trinity_train.config import load_config


def tiny_fsdp_job(overlap=None, **parallel) -> tuple:
    """The tiny model under FSDP over both ranks (`parallel` on top), this rank's batch, and the
    gloo room's `GlooCommunication` as a CPU job installs it (no optimizer: the next forward's
    prefetch is issued by hand). `overlap`: `GlooOverlap`; by default no all-gather is prefetched
    on gloo's threads (a reduce-scatter's bytes are counted alone)."""
    from trinity_train.parallel.gloo.communication import GlooOverlap, install_gloo_communication
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.parallel.parallelize import build_parallel_model

    init_gloo()
    cfg = load_config(None, {"model": dict(TINY_MODEL), "parallel": {"dp_shard": 2, **parallel}})
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    communication = install_gloo_communication(model, None, dims, torch.device("cpu"), cfg.parallel.reduce_wire_dtype,
                                               overlap or GlooOverlap(all_gather=False))
    g = torch.Generator().manual_seed(dist.get_rank())
    return model, torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g), communication


def tiny_fsdp_model(**parallel) -> tuple:
    """`tiny_fsdp_job`'s model and batch."""
    model, ids, _ = tiny_fsdp_job(**parallel)
    return model, ids
