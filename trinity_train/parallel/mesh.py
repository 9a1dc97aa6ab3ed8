"""The parallel layout: how many ranks replicate, shard, split tensors and split experts, and the one
DeviceMesh that names those groups.

The world is `dp_replicate x dp_shard x cp x tp` ranks (torchtitan's order). Context parallelism
(`cp`, `parallel/context_parallel.py`) splits each row over `cp` ranks that read the same rows; for the
weights those ranks are data-parallel ranks like the others: FSDP shards over `dp_shard x cp`
(the flattened dim `dp_shard_cp`; named `dp_shard` when cp = 1) and their gradients sum.
Expert parallelism borrows its ranks from `dp_shard x cp` (as in torchtitan): the `ep` ranks of
a group see different tokens in attention and the dense layers, and exchange tokens so that each
routed expert lives whole on one of them. What is left after `ep` (`efsdp = dp_shard x cp / ep`)
shards the experts FSDP-style: along the expert dim when each rank's `num_experts / ep` experts
split evenly over `efsdp`, otherwise along dim 1 of each weight, so that no rank holds padding
(`expert_shard_dim`, applied by `parallel/fsdp.py`).

Three views of one world mesh name the groups the rest of the code asks for, tp innermost so a
tensor-parallel group sits on neighbouring ranks (one node), then cp, ep, the FSDP shard, and the
HSDP replicas outermost (across nodes); `node_layout` refuses sizes that would not fit the nodes so:

- dense  `(dp_replicate, dp_shard_cp, tp)`: FSDP/HSDP and TP of everything but the routed experts;
- sparse `(dp_replicate, efsdp, ep, tp)`: the routed experts, split over ep (and tp) and sharded
  FSDP-style over efsdp;
- data   `(dp, cp, tp)` (`(dp, tp)` when cp = 1): which slice of the batch a rank reads (dp), which
  share of each row (cp), and, flattened `dp_cp`, what losses and token counts are summed over.

They are unflattened from the same 1-D world mesh, so DTensors and FSDP can combine their dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trinity_train.config import Config, ModelConfig, grad_accum_for, require
from trinity_train.errors import ConfigError
from trinity_train.model.alignment import GROUPED_MM_ALIGNMENT

if TYPE_CHECKING:  # torch is imported by build_mesh: the launchers' preflight checks a layout without it
    from torch.distributed.device_mesh import DeviceMesh


def expert_shard_dim(num_local_experts: int, efsdp: int, width: int) -> int:
    """The dim FSDP shards a stacked routed-expert weight along over its `efsdp` ranks.

    `num_local_experts` and `width` are dims 0 and 1 of this rank's `[E / ep, width, ...]` shard
    after EP and TP (width: I / tp for gate/up, d for down). 0 (whole experts on every rank) when
    the experts split evenly; otherwise 1 when the width does; otherwise 0 all the same (FSDP
    cannot split a dim > 0 unevenly, and pads dim 0). torchtitan's rule, dim 1 when
    `efsdp * ep > num_experts`, is the first uneven case: 32 local experts over efsdp = 64 would
    leave half the ranks a padded slice of nothing, and every all-gather and reduce-scatter would
    move 64 slices for 32 real ones. An uneven split with fewer ranks than experts (3 experts on 2
    ranks) also pads, and goes to dim 1 too. Dim 0 stays first where it is even because a rank then
    holds whole expert matrices, which Muon orthogonalises where they are, with no gather."""
    if num_local_experts % efsdp == 0 or width % efsdp:
        return 0
    return 1


def check_layout_config(cfg: Config) -> None:
    """The layout rules that need no world size (ConfigError naming the key): tp divides the heads,
    the FFN widths and the sequence (each rank holds whole heads, 1/tp of each FFN, 1/tp of the
    sequence); ep divides the experts and a fixed dp_shard. `from_config` checks the rest once the
    ranks are known; `run_config.validate_rules` runs this at load."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    require(m.num_heads % p.tp == 0 and m.num_kv_heads % p.tp == 0, "parallel.tp",
            f"tp={p.tp} must divide model.num_heads={m.num_heads} and model.num_kv_heads="
            f"{m.num_kv_heads} (each rank holds whole heads)")
    for key, width in (("intermediate_size", m.intermediate_size),
                       ("moe_intermediate_size", m.moe_intermediate_size)):
        require(width % p.tp == 0, "parallel.tp",
                f"tp={p.tp} must divide model.{key}={width} (each rank holds 1/tp of the FFN width)")
    require(d.seq_len % p.tp == 0, "parallel.tp",
            f"tp={p.tp} must divide data.seq_len={d.seq_len} (sequence parallelism splits the "
            f"sequence over the tp ranks)")
    require(p.cp == 1 or d.seq_len % (2 * p.cp * p.tp) == 0, "parallel.cp",
            f"data.seq_len={d.seq_len} must be a multiple of 2 x cp x tp = {2 * p.cp * p.tp} (context "
            f"parallelism cuts each row into 2 x cp equal chunks, and tp splits each rank's share again)")
    require(m.num_experts % p.ep == 0, "parallel.ep",
            f"ep={p.ep} must divide model.num_experts={m.num_experts} (each rank holds whole experts)")
    require(p.dp_shard == -1 or (p.dp_shard * p.cp) % p.ep == 0, "parallel.ep",
            f"ep={p.ep} must divide the expert-data-parallel size parallel.dp_shard x cp = "
            f"{p.dp_shard} x {p.cp} (expert parallelism takes its ranks from dp_shard x cp)")


@dataclass
class ParallelDims:
    """Resolved sizes of every parallel dimension, checked against the world size and the model."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    world_size: int
    cp: int = 1  # context parallel: ranks that split each row (after world_size: positional callers)
    mesh: DeviceMesh | None = field(default=None, repr=False)  # the 1-D world, set by build_mesh
    _dense: DeviceMesh | None = field(default=None, repr=False)
    _sparse: DeviceMesh | None = field(default=None, repr=False)
    _data: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)  # by "_".join(dims)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> ParallelDims:
        """Resolve `dp_shard = -1` and reject a layout that cannot run on `world_size` ranks
        (`check_layout_config` first: the rules that need no world size). Where the groups fall on
        the nodes is `node_layout.layout_on_nodes`'s check, on top of this one."""
        check_layout_config(cfg)
        p = cfg.parallel
        fixed = p.dp_replicate * p.cp * p.tp
        cp, cp_key = (f"cp={p.cp} x ", " / parallel.cp") if p.cp > 1 else ("", "")  # named only when used
        if p.dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"parallel: {world_size} ranks cannot be split into dp_replicate={p.dp_replicate} "
                    f"x {cp}tp={p.tp} = {fixed} groups; start a multiple of {fixed} processes or "
                    f"change parallel.dp_replicate{cp_key} / parallel.tp")
            dp_shard = world_size // fixed
        else:
            dp_shard = p.dp_shard
            if fixed * dp_shard != world_size:
                raise ConfigError(
                    f"parallel: dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x {cp}tp={p.tp} = "
                    f"{fixed * dp_shard} ranks, but {world_size} processes were started; start "
                    f"{fixed * dp_shard} processes or set parallel.dp_shard=-1 to use what is left")
        if (dp_shard * p.cp) % p.ep:
            size, dims = (f"dp_shard x cp = {dp_shard} x {p.cp}", "dp_shard x cp") if p.cp > 1 else (
                f"dp_shard={dp_shard}", "dp_shard")
            raise ConfigError(
                f"parallel.ep: ep={p.ep} must divide the expert-data-parallel size {size} (expert parallelism "
                f"takes its ranks from {dims}); choose an ep that divides {dp_shard * p.cp} or start more processes")
        grad_accum_for(cfg.train, p.dp_replicate * dp_shard)  # a fixed global batch must split over the ranks
        m = cfg.model
        if m.expert_impl == "grouped" and (m.moe_intermediate_size // p.tp) % GROUPED_MM_ALIGNMENT:
            raise ConfigError(
                f"parallel.tp: each rank's expert width model.moe_intermediate_size / tp = "
                f"{m.moe_intermediate_size // p.tp} must be a multiple of {GROUPED_MM_ALIGNMENT} for "
                f"model.expert_impl='grouped'; use a smaller tp or model.expert_impl='loop'")
        return cls(p.dp_replicate, dp_shard, p.tp, p.ep, world_size, p.cp)

    @classmethod
    def one_process(cls) -> ParallelDims:
        return cls(1, 1, 1, 1, 1)

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP shards each weight over (HSDP: within a replica): dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that shard each expert FSDP-style: what is left of dp_shard x cp after ep."""
        return self.fsdp_shards // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_dim(self) -> str:
        """The name of the dense view's FSDP dim: the flattened dp_shard x cp."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and its three views (every rank must call this)."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        self._dense = world._unflatten(0, (self.dp_replicate, self.fsdp_shards, self.tp),
                                       ("dp_replicate", self.fsdp_dim, "tp"))
        self._sparse = world._unflatten(0, (self.dp_replicate, self.efsdp, self.ep, self.tp),
                                        ("dp_replicate", "efsdp", "ep", "tp"))
        if self.cp > 1:
            self._data = world._unflatten(0, (self.dp, self.cp, self.tp), ("dp", "cp", "tp"))
        else:
            self._data = world._unflatten(0, (self.dp, self.tp), ("dp", "tp"))
        # Flattened groups for reductions over several dims at once (a global gradient norm of a
        # weight sharded over FSDP and TP is one all-reduce over both, not one per dim).
        for view, dims in self.flattened_views():
            self._flat["_".join(dims)] = view[dims]._flatten("_".join(dims))
        self.mesh = world
        return world

    def flattened_views(self) -> list[tuple[DeviceMesh, tuple[str, ...]]]:
        """(view, dims) of every group `build_mesh` flattens (named "_".join(dims))."""
        shard = self.fsdp_dim
        views = [(self._dense, (shard, "tp")), (self._dense, ("dp_replicate", shard, "tp")),
                 (self._sparse, ("efsdp", "ep")), (self._sparse, ("efsdp", "ep", "tp")),
                 (self._sparse, ("dp_replicate", "efsdp", "ep", "tp"))]
        return views + ([(self._data, ("dp", "cp"))] if self.cp > 1 else [])

    def _require_mesh(self) -> None:
        if self.mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh over all data-parallel ranks (batch slices)."""
        self._require_mesh()
        return self._data["dp"]

    @property
    def token_mesh(self) -> DeviceMesh:
        """1-D mesh over every rank holding other tokens, dp x cp (loss, token-count and
        statistics sums); the dp mesh when cp = 1."""
        self._require_mesh()
        return self._flat["dp_cp"] if self.cp > 1 else self._data["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """1-D mesh over the ranks that split the same rows (context parallelism, cp > 1)."""
        self._require_mesh()
        return self._data["cp"]

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group (0 without cp)."""
        return self.cp_mesh.get_local_rank() if self.cp > 1 and self.mesh is not None else 0

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the non-expert weights: 1-D (FSDP over dp_shard x cp) or 2-D (HSDP:
        replicate, shard)."""
        self._require_mesh()
        shard = self.fsdp_dim
        return self._dense["dp_replicate", shard] if self.dp_replicate > 1 else self._dense[shard]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of expert-parallel routed experts: the data-parallel ranks not used by ep."""
        self._require_mesh()
        return self._sparse["dp_replicate", "efsdp"] if self.dp_replicate > 1 else self._sparse["efsdp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        self._require_mesh()
        return self._dense["tp"]

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The mesh the routed-expert weights are split over: "ep" (whole experts) and/or "tp"
        (their width), or None when neither is on. Without ep the experts stay in their block's
        FSDP unit, so their tp dim comes from the same (dense) view as the block's."""
        self._require_mesh()
        if self.ep > 1:
            return self._sparse["ep", "tp"] if self.tp > 1 else self._sparse["ep"]
        return self._dense["tp"] if self.tp > 1 else None

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.mesh is not None else 0

    @property
    def rank(self) -> int:
        """This process's rank in the world (0 in one process)."""
        return self.mesh.get_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        """The process that writes the run directory's files."""
        return self.rank == 0

    def expert_shard_dims(self, model: ModelConfig) -> dict[str, int]:
        """FSDP's shard dim of each routed-expert weight of `model` under this layout."""
        local = model.num_experts // self.ep
        inner = expert_shard_dim(local, self.efsdp, model.moe_intermediate_size // self.tp)
        return {"gate_proj": inner, "up_proj": inner,
                "down_proj": expert_shard_dim(local, self.efsdp, model.hidden_size)}

    def describe(self, model: ModelConfig | None = None) -> str:
        """The layout in one line; with `model`, also how its routed experts are sharded."""
        line = (f"world={self.world_size} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                + (f"cp={self.cp} " if self.cp > 1 else "") + f"(ep={self.ep} x efsdp={self.efsdp}) tp={self.tp}")
        if model is None or self.efsdp == 1 or model.num_layers <= model.num_dense_layers:
            return line
        shard_dims = self.expert_shard_dims(model)
        if len(set(shard_dims.values())) == 1:
            how = f"dim {shard_dims['gate_proj']}"
        else:
            how = ", ".join(f"{name} dim {dim}" for name, dim in shard_dims.items())
        return (f"{line}; {model.num_experts // self.ep} experts per ep rank, FSDP-sharded along "
                f"{how} over {self.efsdp} ranks")

