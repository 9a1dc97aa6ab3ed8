"""Joining the job: read torchrun's environment, pick the device and backend, build the mesh.

`torchrun` (see `launch/`) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (its processes
per node, which place the mesh's groups on nodes unless `parallel.ranks_per_node` says otherwise)
and the rendezvous address. One process without torchrun is a world of one and needs no process
group. GPUs mean one device per process (LOCAL_RANK) and NCCL; otherwise the CPU and gloo.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from trinity_train.config import Config
from trinity_train.errors import ConfigError
from trinity_train.parallel.config_agreement import require_same_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, layout_on_nodes, nodes_for


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def nodes_from_env(cfg: Config) -> Nodes | None:
    """The ranks per node: `parallel.ranks_per_node`, else torchrun's LOCAL_WORLD_SIZE."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return nodes_for(cfg.parallel, local, "LOCAL_WORLD_SIZE, the launcher's processes per node")


def resolve_device(cfg: Config) -> torch.device:
    """This process's device: `train.device`, where "auto" means a GPU when one is visible."""
    wanted = cfg.train.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was asked for but no GPU is visible; "
                          "use train.device='auto' or 'cpu'")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                          f"visible: start at most that many processes per node (--nproc_per_node)")
    return torch.device("cuda", local_rank)


def init_distributed(cfg: Config) -> tuple[ParallelDims, torch.device]:
    """Check the layout against the world size, join the process group and build the mesh.

    The layout is checked before the process group starts, so a wrong one fails in every rank at
    once with the same message instead of hanging in a collective; right after joining, the
    ranks check that they all run the same config.
    """
    dims = layout_on_nodes(cfg, world_size_from_env(), nodes_from_env(cfg))
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dims.is_distributed:
        return dims, device
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                                timeout=datetime.timedelta(seconds=cfg.parallel.init_timeout_s))
    try:
        require_same_config(cfg)  # before anything is built: every rank refuses a mismatch together
        dims.build_mesh(device.type)
        apply_collective_timeout(cfg.parallel.collective_timeout_s)
    except BaseException:
        destroy_distributed()  # a process leaving with gloo's threads alive aborts (see there)
        raise
    return dims, device


def apply_collective_timeout(seconds: float) -> None:
    """From here on a collective that waits longer than `seconds` fails (every rank's watchdog
    or wait raises, torchrun restarts the job) instead of hanging for torch's 30 minutes.

    Applied to every process group of this process (the world and the mesh's groups, which
    torch creates with its own default), as torchtitan does with its train timeout, after a
    barrier: a slow rank must not still be in a collective under the long joining timeout while
    the others already run under the short one. torch offers no public setter; `_set_pg_timeout`
    is its own helper for exactly this.
    """
    dist.barrier()
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


# How long a gloo rank releases the GIL before tearing down; see `destroy_distributed`.
_GLOO_DRAIN_S = 0.2


def leave_together() -> None:
    """Wait for every rank before tearing down, on the success path only (a failed rank never
    arrives): a rank that closes its connections while a peer is still in a collective makes
    gloo abort that peer."""
    if dist.is_initialized():
        dist.barrier()


def destroy_distributed() -> None:
    """Leave the process group, on every path out of a distributed run.

    gloo's worker threads free each finished collective's tensors themselves, which needs the
    GIL. If that is still pending when the interpreter shuts down, the thread dies inside a
    destructor and the process aborts (SIGABRT, "terminate called without an active exception",
    pytorch/pytorch#190489) after the job has finished, or turns a clean error exit into a crash.
    A short sleep (which releases the GIL) lets the threads drain first.
    """
    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            time.sleep(_GLOO_DRAIN_S)
        dist.destroy_process_group()
