"""The tiny model under FSDP over two gloo ranks: what the FSDP tests build in each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import TINY_MODEL
from trinity_harness.ranks import init_gloo
from trinity_train.config import load_config


def tiny_fsdp_model(**parallel) -> tuple:
    """The tiny model under FSDP over both ranks (`parallel` on top) and this rank's batch. No
    all-gather prefetched on gloo's threads unless `parallel` asks (a reduce-scatter's bytes are
    counted alone)."""
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.parallel.parallelize import build_parallel_model

    init_gloo()
    cfg = load_config(None, {"model": dict(TINY_MODEL),
                             "parallel": {"dp_shard": 2, "prefetch_all_gather": False, **parallel}})
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    g = torch.Generator().manual_seed(dist.get_rank())
    return model, torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g)
