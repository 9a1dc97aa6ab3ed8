"""Where the mesh's groups lie on the nodes, and the layouts refused because a group that needs a
node's fast link would use the slow one between nodes.

Launchers number the ranks node by node: with n ranks per node, node k holds ranks k*n .. k*n+n-1
(torchrun: global rank = node rank x LOCAL_WORLD_SIZE + local rank). The world mesh is
`(dp_replicate, dp_shard, cp, tp)` with the last dim varying fastest, and ep splits dp_shard x cp
as `(efsdp, ep)` (`parallel/mesh.py`), so the groups of a dim are every `stride`-th rank, `size`
of them, and tile blocks of `stride x size` neighbouring ranks. Those blocks lie inside nodes
exactly when the block divides n (or the world is one node). That order is already the one a
cluster wants (tp innermost, then cp and ep, then the FSDP shard, the replicas outermost): nothing
is rearranged, and what can go wrong is a size that does not fit the nodes, refused here in one line:

- tp, cp or ep groups that span nodes (an all-reduce, halo exchange, key/value all-gather or
  all-to-all in every layer on the slow link), unless `parallel.allow_ep_tp_across_nodes`;
- HSDP (dp_replicate > 1) whose shard groups (dp_shard x cp x tp neighbouring ranks) are cut by a node
  boundary, neither inside one node nor made of whole nodes: some groups would all-gather across
  nodes and the replicas' all-reduce partly stay inside one. FSDP alone (dp_replicate = 1) over
  several nodes is the usual layout and stays allowed.

The ranks per node come from `parallel.ranks_per_node`, else from the launcher (`Nodes`); the plan
(`trinity-train plan --gpus-per-node`) checks and prices with the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from trinity_train.config import Config, ParallelConfig
from trinity_train.errors import ConfigError
from trinity_train.parallel.mesh import ParallelDims


@dataclass(frozen=True)
class Nodes:
    """How many neighbouring ranks share a node, and where that count came from (for messages)."""

    ranks: int
    source: str


def layout_on_nodes(cfg: Config, world_size: int, nodes: Nodes | None) -> ParallelDims:
    """`ParallelDims.from_config`, and with `nodes` the layouts refused whose groups would sit
    badly on nodes of that many ranks (`check_groups_within_nodes`)."""
    dims = ParallelDims.from_config(cfg, world_size)
    if nodes is not None:
        check_groups_within_nodes(dims, cfg.parallel, nodes)
    return dims


def nodes_for(p: ParallelConfig, launcher_ranks: int | None, launcher_source: str) -> Nodes | None:
    """`parallel.ranks_per_node` when set, else what the launcher says (None: not known, e.g. one
    process; nothing is checked)."""
    if p.ranks_per_node:
        return Nodes(p.ranks_per_node, "parallel.ranks_per_node")
    if launcher_ranks:
        return Nodes(launcher_ranks, launcher_source)
    return None


def group_stride_and_size(dim: str, dims: ParallelDims) -> tuple[int, int]:
    """The stride between neighbouring ranks of mesh dimension `dim`'s groups, and their size, in
    world order (dp_replicate, dp_shard, cp, tp); ep and efsdp split dp_shard x cp as (efsdp, ep).
    A name not listed stands for the whole world."""
    tp, ep, cp = dims.tp, dims.ep, dims.cp
    table = {"tp": (1, tp), "cp": (tp, cp), "ep": (tp, ep), "efsdp": (tp * ep, dims.efsdp),
             "dp_shard": (tp * cp, dims.dp_shard), "fsdp": (tp, dims.fsdp_shards),
             "dp_shard_cp": (tp, dims.fsdp_shards), "dp_replicate": (tp * dims.fsdp_shards, dims.dp_replicate),
             "dp": (tp * cp, dims.dp), "dp_cp": (tp, dims.dp * cp)}
    return table.get(dim, (1, dims.world_size))


def within_nodes(dim: str, dims: ParallelDims, ranks_per_node: int) -> bool:
    """Whether every group of mesh dimension `dim` lies inside one node."""
    stride, size = group_stride_and_size(dim, dims)
    return size == 1 or dims.world_size <= ranks_per_node or ranks_per_node % (stride * size) == 0


# Of a dim whose groups must stay inside nodes: the product its groups span, and what would cross
# the slow link if they did not.
_NODE_BOUND = {"tp": ("tp", "every layer's tensor-parallel all-reduces and all-gathers"),
               "cp": ("cp x tp", "every attention layer's halo exchange or key/value all-gather"),
               "ep": ("ep x tp", "every MoE layer's token all-to-alls")}


def check_groups_within_nodes(dims: ParallelDims, p: ParallelConfig, nodes: Nodes) -> None:
    """Refuse (ConfigError, one line) a layout whose tp, cp or ep groups span nodes, unless asked, or
    whose HSDP shard groups are cut by a node boundary (see the module doc)."""
    n = nodes.ranks
    if dims.world_size <= n:
        return  # one node holds everything
    where = f"nodes of {n} ranks ({nodes.source}; {-(-dims.world_size // n)} nodes)"
    if not p.allow_ep_tp_across_nodes:
        for dim, (span, traffic) in _NODE_BOUND.items():
            if within_nodes(dim, dims, n):
                continue
            stride, size = group_stride_and_size(dim, dims)
            raise ConfigError(
                f"parallel.{dim}: {dim}={size} would put its groups across nodes: each spans {span} = "
                f"{stride * size} neighbouring ranks, which {where} do not hold whole, so {traffic} would "
                f"cross the slow link between nodes; make {span} divide {n} (or start more ranks per "
                f"node), or set parallel.allow_ep_tp_across_nodes=true to run it anyway")
    span = dims.fsdp_shards * dims.tp
    if dims.dp_replicate > 1 and n % span and span % n:
        raise ConfigError(
            f"parallel.dp_shard: HSDP's shard groups (dp_shard x cp x tp = {span} neighbouring ranks) are "
            f"cut by the boundaries of {where}, so some would all-gather across nodes; make dp_shard x cp "
            f"x tp divide {n} (shards inside a node, replicas across nodes) or a multiple of it (whole nodes)")
