"""A plan of one job: the layout checked, its rank classes found and each traced (`trace`).

`plan_job` is what `trinity-train plan` runs; `report` prints it. The layout is checked first
with the same rules a launch uses (`ParallelDims.from_config`, with the plan's GPUs per node as
the launch's ranks per node: tp and ep groups inside a node unless
`parallel.allow_ep_tp_across_nodes`); a layout that cannot run is refused in one line that names
valid layouts near it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trinity_train.config import Config, grad_accum_for
from trinity_train.errors import ConfigError
from trinity_train.model import build_model
from trinity_train.parallel.assumed_routing import AssumedRouting
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, layout_on_nodes
from trinity_train.parallel.parallelize import split_model
from trinity_train.plan.fake_world import fake_world
from trinity_train.plan.rank_classes import RankClass, rank_classes
from trinity_train.plan.trace import RankTrace, trace_rank


@dataclass
class JobPlan:
    cfg: Config
    dims: ParallelDims
    gpus_per_node: int
    gpu: bool
    routing: AssumedRouting
    classes: list[RankClass]
    traces: list[RankTrace]  # one per class, in the same order

    @property
    def grad_accum(self) -> int:
        return grad_accum_for(self.cfg.train, self.dims.dp)

    @property
    def global_batch(self) -> int:
        return self.cfg.train.micro_batch_size * self.grad_accum * self.dims.dp

    def crosses_nodes(self, ranks: tuple[int, ...]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    @property
    def checkpoint_bytes(self) -> int:
        """The whole checkpoint: every class's share, once per replica group (DCP writes
        replicated state once)."""
        per_replica = sum(t.checkpoint_bytes * c.ranks for c, t in zip(self.classes, self.traces))
        return per_replica // self.dims.dp_replicate


def layout_for(cfg: Config, world_size: int, nodes: Nodes) -> ParallelDims:
    """`ParallelDims.from_config`, with valid layouts near a refused one named in the message."""
    try:
        return layout_on_nodes(cfg, world_size, nodes)
    except ConfigError as e:
        near = nearby_layouts(cfg, world_size, nodes)
        hint = f"; valid near it: {'; '.join(near)}" if near else ""
        raise ConfigError(f"{e}{hint}") from None


def nearby_layouts(cfg: Config, world_size: int, nodes: Nodes, limit: int = 3) -> list[str]:
    """Up to `limit` changes that make the layout valid: another world size with the same
    settings, or another ep / tp / cp / dp_replicate (dp_shard = what is left) at this world size."""
    p = cfg.parallel

    def valid(world: int, **changes) -> bool:
        parallel = dataclasses.replace(p, **changes)
        try:
            layout_on_nodes(dataclasses.replace(cfg, parallel=parallel), world, nodes)
        except ConfigError:
            return False
        return True

    found = []
    for delta in range(1, world_size):
        for world in (world_size - delta, world_size + delta):
            if world > 0 and valid(world):
                found.append(f"--world {world}")
        if found:
            break
    for key, values in (("ep", _divisors(cfg.model.num_experts)), ("tp", (1, 2, 4, 8)), ("cp", (1, 2, 4, 8)),
                        ("dp_replicate", _divisors(world_size))):
        current = getattr(p, key)
        for value in sorted(values, key=lambda v: (abs(v - current), v)):
            if value != current and valid(world_size, **{key: value, "dp_shard": -1}):
                found.append(f"--parallel.{key}={value} --parallel.dp_shard=-1")
                break
    return found[:limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def find_rank_classes(cfg: Config, dims: ParallelDims) -> list[RankClass]:
    """Build the model on the meta device and split it (TP, EP) as rank 0 of the job would, then
    group the ranks by the FSDP chunks they would hold."""
    if not dims.is_distributed:
        return [RankClass(0, 1, 0)]
    with fake_world(dims.world_size, 0):
        probe = ParallelDims.from_config(cfg, dims.world_size)
        probe.build_mesh("cpu")
        model = build_model(cfg.model, device="meta")
        split_model(model, probe)
        return rank_classes(model, probe)


def plan_job(cfg: Config, world_size: int, *, nodes: Nodes, gpu: bool,
             routing: AssumedRouting = AssumedRouting(), progress=None) -> JobPlan:
    """Check the layout on `nodes`, find the rank classes and trace one rank of each (one after
    another in this process: `fake_world` forgets DTensor's cached decisions between them)."""
    dims = layout_for(cfg, world_size, nodes)
    classes = find_rank_classes(cfg, dims)
    traces = []
    for c in classes:
        if progress is not None:
            progress(f"tracing rank {c.rank} of {world_size} ({c.ranks} ranks like it)")
        traces.append(trace_rank(cfg, world_size, c.rank, gpu=gpu, routing=routing))
    return JobPlan(cfg, dims, nodes.ranks, gpu, routing, classes, traces)

