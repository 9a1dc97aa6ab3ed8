"""The candidates that fit N GPUs, ranked by predicted step time (`trinity-train plan --search`).

What is tried is `search_space.py`'s: every layout, every micro-batch size that splits a rank's
rows, activation checkpointing on and off, the loss chunks, and the policies a user can set.
Every candidate is priced by the closed-form model alone (`formula.py`, `timing.py`): no tracing.
The global batch stays the config's (`train.global_batch_size`, else micro_batch_size x
grad_accum x its data-parallel ranks at N), so every candidate trains the same tokens per step
and step times compare.

A candidate fits when its formula peak plus the reserve (`hardware.Reserve`) is below the GPU's
memory; the fitting ones are ranked by the step time with full overlap, then without (the real
step lies between: of two compute-bound candidates, the one with less communication has more
slack), then by memory. Candidates that keep the config's wire dtypes are ranked in one list;
those that change one (bf16 on the wire: other numerics) in a second, never mixed. Of candidates
equal in memory and time on one layout and batch, the first (the one that changes the config
least, and the largest loss chunk: fewest head matmuls) stands for them.

Tens of thousands of candidates are too many to price one by one in a minute, so the search
prices a *base* (layout, micro-batch, checkpointing) twice first: its memory under the policies
that need the least (nothing kept gathered, gradients reduced every micro-batch, experts gathered
per micro-batch, the smallest loss chunk, bf16 gradients on the wire) -- if that does not fit,
nothing of the base does -- and its traffic under those that send the least (every block kept
gathered, one reduction a step, experts gathered once), a lower bound on its step times. Bases
are then opened best bound first, and the search stops where no base's bound can enter the list.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from trinity_train.config import Config
from trinity_train.errors import ConfigError
from trinity_train.parallel.assumed_routing import AssumedRouting
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes
from trinity_train.plan.formula import communicators, memory_per_rank, traffic_per_rank
from trinity_train.plan.hardware import DEFAULT_NODES, DEFAULT_RESERVE, Hardware, Reserve
from trinity_train.plan.search_space import (LOSS_CHUNKS, Layout, Policy, Setting, crosses_nodes, layouts,
                                             micro_batch_sizes, no_layout_reason, policies, reshard_values)
from trinity_train.plan.timing import DEFAULT_MFU, StepTime, bottleneck, step_time

__all__ = ["Candidate", "Layout", "SearchResult", "global_batch", "layouts", "search"]


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # ready `--section.key=value` overrides
    dims: ParallelDims
    setting: Setting
    grad_accum: int  # micro-batches per step, derived from the global batch
    memory_bytes: float  # formula peak + reserve
    time: StepTime
    bound: str  # "compute-bound", or "bound by <link>: <its largest flow>" (timing.bottleneck)

    @property
    def key(self) -> tuple[float, float, float]:
        return (*self.time.rank_key, self.memory_bytes)


@dataclass
class SearchResult:
    candidates: list[Candidate]  # the config's numerics, fastest first
    other_numerics: list[Candidate]  # a wire dtype changed (bf16 on the wire), fastest first
    layouts: int  # layouts enumerated
    priced: int  # candidates priced in full (memory and step time)


def global_batch(cfg: Config, world: int) -> int:
    """The global batch in sequences that every candidate keeps."""
    t, p = cfg.train, cfg.parallel
    if t.global_batch_size:
        return t.global_batch_size
    return t.micro_batch_size * t.grad_accum * (world // (p.tp * p.cp))


class _Top:
    """The `n` best candidates seen, by `Candidate.key`."""

    def __init__(self, n: int):
        self.n, self.items = n, []

    def admits(self, bound: tuple[float, float]) -> bool:
        return len(self.items) < self.n or bound <= self.items[-1].key[:2]

    def add(self, c: Candidate) -> None:
        bisect.insort(self.items, c, key=lambda x: x.key)  # stable: an equal key goes after, the simpler stays first
        del self.items[self.n:]


@dataclass
class _Base:
    """A layout, micro-batch and checkpointing choice, with what its policies share."""

    layout: Layout
    dims: ParallelDims
    micro: int
    accum: int
    ac: bool
    across: bool
    policies: list[Policy]
    bounds: dict[bool, tuple[float, float]]  # same numerics? -> the least (overlap, no overlap) it can reach


def _extreme(pols: list[Policy], cfg: Config, least: str, same: bool | None = None) -> Policy:
    """The policy of the values in `pols` that need the least memory (least="memory") or send the
    least (least="traffic"); wires the config's when `same`, else the smaller ones."""
    def pick(field, order):
        values = {getattr(p, field) for p in pols}
        return next(v for v in order if v in values)

    memory = least == "memory"
    gib = (min if memory else max)(p.keep_gathered_gib for p in pols)
    sync = pick("sync_every_micro_batch", (True, False) if memory else (False, True))
    gather = pick("expert_gather", ("micro_batch", "step") if memory else ("step", "micro_batch"))
    if same:
        wires = cfg.parallel.reduce_wire_dtype, cfg.parallel.ep_wire_dtype
    else:
        wires = pick("reduce_wire_dtype", ("bf16", "full")), pick("ep_wire_dtype", ("bf16", "full"))
    return Policy(gib, sync, gather, *wires)


def search(cfg: Config, world: int, hardware: Hardware, *, nodes: Nodes = DEFAULT_NODES, top: int = 10,
           mfu: float = DEFAULT_MFU, reserve: Reserve = DEFAULT_RESERVE, gpu: bool = True,
           routing: AssumedRouting = AssumedRouting(), max_cp: int = 1, fixed: dict[str, int] | None = None,
           across_nodes: bool = False) -> SearchResult:
    """The `top` fitting candidates for `world` GPUs in each numerics class, fastest first (see the
    module doc); each priced at the routing assumption `routing` (the hottest rank's experts), with
    up to `max_cp` context-parallel ranks, the layout sizes in `fixed` kept, and tp, cp and ep
    groups across nodes only when `across_nodes`."""
    fixed = fixed or {}
    batch, gpn = global_batch(cfg, world), nodes.ranks
    found = layouts(cfg, world, gpn, max_cp, fixed=fixed, across_nodes=across_nodes)
    if fixed and not found:
        raise ConfigError(no_layout_reason(cfg, world, gpn, fixed, across_nodes))

    def setting(base: _Base, policy: Policy, chunk: int) -> Setting:
        return Setting(base.layout, base.micro, batch, base.ac, chunk, policy, base.across)

    def fits(s: Setting) -> float | None:
        """Memory with the reserve, or None when it does not fit."""
        memory = memory_per_rank(s.apply(cfg), s.layout.dims(world), gpu=gpu, routing=routing)
        total = memory.peak + reserve.total(memory.peak, communicators(s.layout.dims(world)))
        return total if total <= hardware.memory_bytes else None

    def priced(base: _Base, policy: Policy) -> tuple[StepTime, list]:
        candidate = setting(base, policy, LOSS_CHUNKS[0]).apply(cfg)  # the chunk does not change the bytes
        flows = traffic_per_rank(candidate, base.dims, gpu=gpu, routing=routing)
        return step_time(candidate, base.dims, flows, hardware, gpn, mfu), flows

    bases: list[_Base] = []
    for layout in found:
        dims = layout.dims(world)
        reshard = reshard_values(cfg, dims, gpu)
        for micro in micro_batch_sizes(batch, layout.dp):
            accum = batch // (micro * layout.dp)
            pols = policies(cfg, dims, accum, reshard, gpu)
            for ac in (False, True):
                base = _Base(layout, dims, micro, accum, ac, crosses_nodes(layout, world, gpn), pols, {})
                if fits(setting(base, _extreme(pols, cfg, "memory"), LOSS_CHUNKS[-1])) is None:
                    continue  # the least memory it can need does not fit: nothing of it does
                for same in (True, False):
                    if any(p.same_numerics(cfg) == same for p in pols):
                        t, _ = priced(base, _extreme(pols, cfg, "traffic", same))
                        base.bounds[same] = t.rank_key
                bases.append(base)

    lists, count = {True: _Top(top), False: _Top(top)}, 0
    for same, best in lists.items():
        for base in sorted((b for b in bases if same in b.bounds), key=lambda b: b.bounds[same]):
            if not best.admits(base.bounds[same]):
                break  # sorted by bound: no later base can enter either
            seen = set()  # (memory, time) of this base's candidates: the first of equals stands for them
            for policy in (p for p in base.policies if p.same_numerics(cfg) == same):
                sized = []  # the loss chunks that fit, largest first, a smaller one only where it saves memory
                for chunk in LOSS_CHUNKS:
                    total = fits(setting(base, policy, chunk))
                    if total is not None and total not in (m for _, m in sized):
                        sized.append((chunk, total))
                if not sized:
                    continue
                time, flows = priced(base, policy)
                count += 1
                for chunk, total in sized:
                    mark = (total, *time.rank_key)
                    if mark in seen:
                        continue
                    seen.add(mark)
                    s = setting(base, policy, chunk)
                    best.add(Candidate(s.overrides(cfg), base.dims, s, base.accum, total, time,
                                       bottleneck(flows, base.dims, time, hardware, gpn)))
    return SearchResult(lists[True].items, lists[False].items, len(found), count)
