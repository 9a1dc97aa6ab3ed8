"""The layouts that fit N GPUs, ranked by predicted step time (`trinity-train plan --search`).

Every candidate is priced by the closed-form model alone (`formula.py`, `timing.py`): no
tracing, so thousands of candidates cost seconds even at N = 2,048. A candidate is
dp_replicate x dp_shard x cp x tp = N (ep inside dp_shard x cp, dividing the experts; tp dividing
the heads, the kv heads, the FFN widths and the sequence; cp up to `max_cp`, 2 x cp x tp dividing
the sequence; tp, cp and ep groups inside a node, by the rule training checks,
`parallel.node_layout`), a micro-batch
size, activation checkpointing on or off, and a loss chunk size. The global batch stays the
config's (`train.global_batch_size`, else micro_batch_size x grad_accum x its data-parallel
ranks at N), so every candidate trains the same tokens per step and step times compare.
A candidate fits when its formula peak plus the reserve (`hardware.Reserve`) is below the GPU's
memory; the fitting ones are ranked by the step time with full overlap (ties: less memory).
A smaller loss chunk is listed only where the formula says it saves memory (under activation
checkpointing a recomputed block usually outweighs the chunk): otherwise the largest, which
launches the fewest head matmuls, stands for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trinity_train.config import Config
from trinity_train.errors import ConfigError
from trinity_train.parallel.assumed_routing import AssumedRouting
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, layout_on_nodes, within_nodes
from trinity_train.plan.formula import communicators, memory_per_rank, traffic_per_rank
from trinity_train.plan.hardware import DEFAULT_NODES, DEFAULT_RESERVE, Hardware, Reserve
from trinity_train.plan.timing import DEFAULT_MFU, StepTime, step_time

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LOSS_CHUNKS = (2048, 4096, 8192)


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # ready `--section.key=value` overrides
    dims: ParallelDims
    memory_bytes: float  # formula peak + reserve
    time: StepTime


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(cfg: Config, world: int) -> int:
    """The global batch in sequences that every candidate keeps."""
    t, p = cfg.train, cfg.parallel
    if t.global_batch_size:
        return t.global_batch_size
    return t.micro_batch_size * t.grad_accum * (world // (p.tp * p.cp))


def _tp_fits(cfg: Config, tp: int) -> bool:
    m = cfg.model
    return (m.num_heads % tp == 0 and m.num_kv_heads % tp == 0
            and m.intermediate_size % tp == 0 and m.moe_intermediate_size % tp == 0
            and cfg.data.seq_len % tp == 0)


def layouts(cfg: Config, world: int, gpus_per_node: int, max_cp: int = 1) -> list[Layout]:
    """Every layout of `world` ranks the rules admit with at most `max_cp` context-parallel ranks,
    tp, cp and ep groups inside a node of `gpus_per_node` (whatever
    `parallel.allow_ep_tp_across_nodes` says: a search proposes no layout with per-layer traffic on
    the slow link)."""
    out = []
    for tp in _divisors(world):
        if not _tp_fits(cfg, tp):
            continue
        for dp_replicate in _divisors(world // tp):
            shards = world // tp // dp_replicate  # dp_shard x cp
            for cp in _divisors(shards):
                if cp > max_cp or (cp > 1 and cfg.data.seq_len % (2 * cp * tp)):
                    continue
                for ep in _divisors(shards):
                    dims = ParallelDims(dp_replicate, shards // cp, tp, ep, world, cp)
                    if cfg.model.num_experts % ep == 0 and all(within_nodes(d, dims, gpus_per_node)
                                                               for d in ("tp", "cp", "ep")):
                        out.append(Layout(dp_replicate, shards // cp, cp, tp, ep))
    return out


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int


def _with(cfg: Config, layout: Layout, micro: int, ac: bool, chunk: int, batch: int) -> Config:
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **dataclasses.asdict(layout)),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum=1, global_batch_size=batch,
                                  activation_checkpointing=ac),
        model=dataclasses.replace(cfg.model, loss_chunk_tokens=chunk))


def search(cfg: Config, world: int, hardware: Hardware, *, nodes: Nodes = DEFAULT_NODES, top: int = 10,
           mfu: float = DEFAULT_MFU, reserve: Reserve = DEFAULT_RESERVE, gpu: bool = True,
           routing: AssumedRouting = AssumedRouting(), max_cp: int = 1) -> list[Candidate]:
    """The `top` fitting candidates for `world` GPUs, fastest first (see the module doc); each
    priced at the routing assumption `routing` (the hottest rank's experts), with up to `max_cp`
    context-parallel ranks."""
    batch = global_batch(cfg, world)
    gpus_per_node = nodes.ranks
    found: list[Candidate] = []
    for layout in layouts(cfg, world, gpus_per_node, max_cp):
        dp = layout.dp_replicate * layout.dp_shard
        for micro in MICRO_BATCH_SIZES:
            if batch % (micro * dp):
                continue  # the global batch must split into whole micro-batches
            for ac in (False, True):
                priced: set[float] = set()  # memory totals of this layout's larger loss chunks
                for chunk in sorted(LOSS_CHUNKS, reverse=True):
                    candidate = _with(cfg, layout, micro, ac, chunk, batch)
                    try:
                        dims = layout_on_nodes(candidate, world, nodes)
                    except ConfigError:
                        continue
                    memory = memory_per_rank(candidate, dims, gpu=gpu, routing=routing)
                    total = memory.peak + reserve.total(memory.peak, communicators(dims))
                    if total > hardware.memory_bytes or total in priced:
                        continue  # too large, or a smaller chunk that saves nothing (the largest is kept)
                    priced.add(total)
                    flows = traffic_per_rank(candidate, dims, gpu=gpu, routing=routing)
                    timing = step_time(candidate, dims, flows, hardware, gpus_per_node, mfu)
                    overrides = (*(f"--parallel.{key}={value}" for key, value in dataclasses.asdict(layout).items()
                                   if key != "cp" or max_cp > 1),
                                 f"--train.micro_batch_size={micro}", "--train.grad_accum=1",
                                 f"--train.global_batch_size={batch}",
                                 f"--train.activation_checkpointing={str(ac).lower()}",
                                 f"--model.loss_chunk_tokens={chunk}")
                    found.append(Candidate(overrides, dims, total, timing))
    found.sort(key=lambda c: (c.time.overlap_s, c.memory_bytes))
    return found[:top]
