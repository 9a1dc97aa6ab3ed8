"""Which ranks of a job hold different local shapes, so that one trace per class covers the job.

TP and EP split evenly (`ParallelDims` refuses uneven splits), and replicas are copies, so local
shapes differ only along the FSDP dimensions: FSDP cuts each parameter into `n` chunks the way
`torch.chunk` does (ceil(S / n) rows each, the last ones shorter or empty). A rank's signature is
the length of its chunk of every parameter; ranks with equal signatures allocate and send the
same, and the class is represented by its first rank (dp_replicate 0, tp 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import DTensor

from trinity_train.parallel.mesh import ParallelDims, expert_shard_dim

MAX_TRACED = 4  # more classes than this: trace the first, the last and the extremes of local size


@dataclass(frozen=True)
class RankClass:
    rank: int  # the representative's global rank
    ranks: int  # how many ranks of the world the class holds
    local_elements: int  # parameter elements one of its ranks holds (without FSDP's padding)


def chunk_length(size: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when `torch.chunk` cuts `size` rows into `parts`."""
    step = math.ceil(size / parts) if size else 0
    return max(0, min(step, size - index * step))


def fsdp_units(model, dims: ParallelDims) -> list[tuple[tuple[int, ...], int, bool]]:
    """(local shape after TP/EP, the dim FSDP shards, routed expert?) of every parameter of a
    model that `split_model` has split (FSDP not yet applied). Routed experts are sharded over
    efsdp (= dp_shard x cp without EP) along `expert_shard_dim`'s dim, everything else along dim 0
    over dp_shard x cp (`parallel.fsdp`)."""
    expert_ids = {id(p) for moe in model.moe_layers for p in moe.experts.parameters()}
    out = []
    for p in model.parameters():
        shape = tuple((p._local_tensor if isinstance(p, DTensor) else p).shape)
        is_expert = id(p) in expert_ids
        dim = expert_shard_dim(shape[0], dims.efsdp, shape[1]) if is_expert else 0
        out.append((shape, dim, is_expert))
    return out


def _signature(units, dims: ParallelDims, d: int) -> tuple[int, ...]:
    return tuple(chunk_length(shape[dim], dims.efsdp if expert else dims.fsdp_shards, d // dims.ep if expert else d)
                 for shape, dim, expert in units)


def rank_classes(model, dims: ParallelDims) -> list[RankClass]:
    """The classes of ranks with equal local shapes (see the module doc), in the order of their
    first FSDP shard index (over dp_shard x cp); beyond `MAX_TRACED` classes only the first, the last, the largest and
    the smallest are returned (the others are left out of a plan's tables and totals)."""
    units = fsdp_units(model, dims)
    by_signature: dict[tuple[int, ...], list[int]] = {}
    sizes: dict[tuple[int, ...], int] = {}
    for d in range(dims.fsdp_shards):
        signature = _signature(units, dims, d)
        by_signature.setdefault(signature, []).append(d)
        if signature not in sizes:
            sizes[signature] = sum(length * math.prod(shape) // max(shape[dim], 1)
                                   for length, (shape, dim, _) in zip(signature, units))
    per_index = dims.world_size // dims.fsdp_shards
    classes = [RankClass(indices[0] * dims.tp, len(indices) * per_index, sizes[sig])
               for sig, indices in by_signature.items()]
    if len(classes) <= MAX_TRACED:
        return classes
    keep = {classes[0], classes[-1], max(classes, key=lambda c: c.local_elements),
            min(classes, key=lambda c: c.local_elements)}
    return [c for c in classes if c in keep]
