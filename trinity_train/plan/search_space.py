"""What `trinity-train plan --search` tries: the layouts of N GPUs, the micro-batch sizes, and the
policies a user can set, each as the ready `--section.key=value` overrides that select it.

- A layout is dp_replicate x dp_shard x cp x tp = N, ep inside dp_shard x cp dividing the experts,
  tp dividing the heads, the kv heads, the FFN widths and the sequence, cp up to `max_cp` with
  2 x cp x tp dividing the sequence, and the node rules training checks
  (`parallel.node_layout`): tp, cp and ep groups inside a node unless `across_nodes` (then their
  configs set `parallel.allow_ep_tp_across_nodes`), HSDP shard groups inside a node or on whole
  nodes. Sizes the user gave on the command line (`fixed`) are kept, the others searched.
- The micro-batch sizes are every divisor of the rows a data-parallel rank reads per step (the
  global batch / dp); the accumulation follows (`train.grad_accum` stays 1: with
  `train.global_batch_size` set, the config derives it, and refuses any other value).
- The policies (`Policy`): the reshard policy `keep_gathered_gib` (the config's, 0, inf; a value
  that keeps the same blocks gathered as an earlier one is dropped), `sync_every_micro_batch`
  (both only with more than one micro-batch), `expert_gather` (both only for a MoE model whose
  experts are sharded, and only where it differs: with one micro-batch and every block kept
  gathered, "step" changes nothing), and the wire dtypes `reduce_wire_dtype` and `ep_wire_dtype`
  (where the other value changes the bytes: the EP wire only under ep > 1, and "bf16" is what a
  bf16 job sends anyway). Each list starts with the config's own value, so the first of equal
  candidates is the one that changes least.

A candidate whose wire dtypes are the config's keeps the config's numerics; one that changes
either wire dtype rounds differently, and is ranked apart (`Policy.same_numerics`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trinity_train.config import Config
from trinity_train.errors import ConfigError
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, check_groups_within_nodes, within_nodes
from trinity_train.plan.formula import Numerics, block_gathered_bytes, blocks_kept_gathered, model_params

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
LOSS_CHUNKS = (8192, 4096, 2048)  # largest first: it launches the fewest head matmuls
WIRES = ("full", "bf16")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dims(self, world: int) -> ParallelDims:
        return ParallelDims(self.dp_replicate, self.dp_shard, self.tp, self.ep, world, self.cp)


@dataclass(frozen=True)
class Policy:
    """The settings besides the layout and the batch that change memory or traffic."""

    keep_gathered_gib: float
    sync_every_micro_batch: bool
    expert_gather: str
    reduce_wire_dtype: str
    ep_wire_dtype: str

    def same_numerics(self, cfg: Config) -> bool:
        """Whether this policy sends what the config sends (its wire dtypes are the config's)."""
        return (self.reduce_wire_dtype, self.ep_wire_dtype) == (cfg.parallel.reduce_wire_dtype,
                                                                cfg.parallel.ep_wire_dtype)


@dataclass(frozen=True)
class Setting:
    """One candidate's choices: what `apply` writes into the config and `overrides` prints."""

    layout: Layout
    micro_batch_size: int
    global_batch_size: int
    activation_checkpointing: bool
    loss_chunk_tokens: int
    policy: Policy
    across_nodes: bool  # its tp, cp or ep groups span nodes (needs allow_ep_tp_across_nodes)

    def keys(self, cfg: Config) -> dict[str, object]:
        """Every key the candidate sets, `section.key` -> value, in the order they print; the wire
        dtypes only where they differ from the config's (the other-numerics list)."""
        keys: dict[str, object] = {f"parallel.{k}": v for k, v in dataclasses.asdict(self.layout).items()}
        keys |= {"train.micro_batch_size": self.micro_batch_size, "train.grad_accum": 1,
                 "train.global_batch_size": self.global_batch_size,
                 "train.activation_checkpointing": self.activation_checkpointing,
                 "model.loss_chunk_tokens": self.loss_chunk_tokens}
        keys |= {f"parallel.{k}": v for k, v in dataclasses.asdict(self.policy).items()
                 if not k.endswith("_wire_dtype") or v != getattr(cfg.parallel, k)}
        if self.across_nodes:
            keys["parallel.allow_ep_tp_across_nodes"] = True
        return keys

    def apply(self, cfg: Config) -> Config:
        sections: dict[str, dict] = {}
        for path, value in self.keys(cfg).items():
            section, key = path.split(".")
            sections.setdefault(section, {})[key] = value
        return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})

    def overrides(self, cfg: Config) -> tuple[str, ...]:
        return tuple(f"--{path}={_text(value)}" for path, value in self.keys(cfg).items())


def _text(value: object) -> str:
    """A value as the config parser reads it back (true/false, inf, 0.5)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "inf" if value == math.inf else f"{value:g}"
    return str(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_fits(cfg: Config, tp: int) -> bool:
    m = cfg.model
    return (m.num_heads % tp == 0 and m.num_kv_heads % tp == 0
            and m.intermediate_size % tp == 0 and m.moe_intermediate_size % tp == 0
            and cfg.data.seq_len % tp == 0)


def crosses_nodes(layout: Layout, world: int, gpus_per_node: int) -> bool:
    """Whether the layout's tp, cp or ep groups span nodes."""
    dims = layout.dims(world)
    return not all(within_nodes(d, dims, gpus_per_node) for d in ("tp", "cp", "ep"))


def layouts(cfg: Config, world: int, gpus_per_node: int, max_cp: int = 1, *, fixed: dict[str, int] | None = None,
            across_nodes: bool = False) -> list[Layout]:
    """Every layout of `world` ranks the rules admit (the module doc), with the sizes in `fixed`
    and at most `max_cp` context-parallel ranks (or the fixed cp)."""
    fixed = fixed or {}
    max_cp = max(max_cp, fixed.get("cp", 1))
    nodes = Nodes(gpus_per_node, "--gpus-per-node")
    rules = dataclasses.replace(cfg.parallel, allow_ep_tp_across_nodes=across_nodes)
    out = []
    for tp in divisors(world):
        if not _tp_fits(cfg, tp):
            continue
        for dp_replicate in divisors(world // tp):
            shards = world // tp // dp_replicate  # dp_shard x cp
            for cp in divisors(shards):
                if cp > max_cp or (cp > 1 and cfg.data.seq_len % (2 * cp * tp)):
                    continue
                for ep in divisors(shards):
                    layout = Layout(dp_replicate, shards // cp, cp, tp, ep)
                    if cfg.model.num_experts % ep or any(getattr(layout, k) != v for k, v in fixed.items()):
                        continue
                    try:
                        check_groups_within_nodes(layout.dims(world), rules, nodes)
                    except ConfigError:
                        continue
                    out.append(layout)
    return out


def no_layout_reason(cfg: Config, world: int, gpus_per_node: int, fixed: dict[str, int], across_nodes: bool) -> str:
    """Why the sizes in `fixed` admit no layout of `world` GPUs, in words (for one ConfigError line)."""
    given = " ".join(f"--parallel.{k}={v}" for k, v in fixed.items())
    product = math.prod(v for k, v in fixed.items() if k != "ep")
    if world % product:
        return (f"{given} leave no layout of {world} GPUs: their product without ep ({product}) does not "
                f"divide the world ({world})")
    if "tp" in fixed and not _tp_fits(cfg, fixed["tp"]):
        return f"{given} leave no layout: tp={fixed['tp']} does not divide the heads, kv heads, FFN widths and sequence"
    if "ep" in fixed and cfg.model.num_experts % fixed["ep"]:
        return f"{given} leave no layout: ep={fixed['ep']} does not divide the {cfg.model.num_experts} experts"
    if not across_nodes and layouts(cfg, world, gpus_per_node, fixed=fixed, across_nodes=True):
        return (f"{given} leave no layout of {world} GPUs whose tp, cp and ep groups stay inside nodes of "
                f"{gpus_per_node}: add --across-nodes to search layouts whose groups span nodes")
    return (f"{given} leave no layout of {world} GPUs: ep must divide dp_shard x cp, and the sizes must "
            f"meet the node rules (tp, cp and ep groups, HSDP shard groups on nodes of {gpus_per_node})")


def reshard_values(cfg: Config, dims: ParallelDims, gpu: bool) -> dict[float, bool]:
    """The config's keep_gathered_gib, 0 and inf, each only where it keeps other blocks gathered
    than the values before it (formula.blocks_kept_gathered at this layout's block sizes); each
    with whether it keeps every block gathered."""
    bytes_ = block_gathered_bytes(model_params(cfg.model, dims.tp, dims.ep), dims, Numerics.of(cfg, gpu).compute)
    seen, out = set(), {}
    for gib in (cfg.parallel.keep_gathered_gib, 0.0, math.inf):
        kept = tuple(blocks_kept_gathered(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, keep_gathered_gib=gib)), bytes_))
        if kept not in seen:
            seen.add(kept)
            out[gib] = all(kept)
    return out


def _config_first(value, others):
    return [value, *(v for v in others if v != value)]


def policies(cfg: Config, dims: ParallelDims, accum: int, reshard: dict[float, bool], gpu: bool) -> list[Policy]:
    """The policies worth pricing for one layout and accumulation (the module doc), the config's
    own first."""
    p, m = cfg.parallel, cfg.model
    syncs = _config_first(p.sync_every_micro_batch, (True, False)) if accum > 1 else [p.sync_every_micro_batch]
    moe = m.num_layers > m.num_dense_layers and m.num_experts > 0
    experts_sharded = moe and (dims.efsdp > 1 or dims.dp_replicate > 1)
    gathers = _config_first(p.expert_gather, ("micro_batch", "step")) if experts_sharded else [p.expert_gather]
    nums = Numerics.of(cfg, gpu)
    reduce_wires = _config_first(p.reduce_wire_dtype, WIRES) if dims.is_distributed else [p.reduce_wire_dtype]
    ep_wires = [p.ep_wire_dtype]
    if moe and dims.ep > 1:  # the other EP wire only where it sends other bytes
        ep_wires += [w for w in WIRES if w != p.ep_wire_dtype and Numerics.of(
            dataclasses.replace(cfg, parallel=dataclasses.replace(p, ep_wire_dtype=w)), gpu).ep_wire != nums.ep_wire]
    out = []
    for gib, everything_kept in reshard.items():
        for sync in syncs:
            for gather in gathers:
                if accum == 1 and everything_kept and gather != gathers[0]:
                    continue  # one micro-batch, every block kept gathered anyway: "step" is the same
                out += [Policy(gib, sync, gather, rw, ew) for rw in reduce_wires for ew in ep_wires]
    return out


def micro_batch_sizes(batch: int, dp: int) -> list[int]:
    """Every micro-batch size that splits a data-parallel rank's rows (`batch` / `dp`) evenly;
    none when the global batch does not split over `dp` ranks."""
    return divisors(batch // dp) if batch % dp == 0 else []
