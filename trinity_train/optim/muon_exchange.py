"""Muon's exchange as packed all-to-alls: every matrix of a gather group in one call each way.

`optim/muon.py` deals the matrices of a gather group (the ranks over which one matrix is split)
to owners. The round-by-round path stacks n slots per round and lets DTensor redistribute the
stack: two collectives per round (44 a step for the default job), the zero slots of a short
round sent as well, and on a CPU mesh DTensor replaces the all-to-all by an all-gather and a
chunk (torch/distributed/tensor/_collective_utils.py: "CPU process group does not support
alltoall yet"), so each rank sends every slot whole. Here, for the common layout where the group
is one mesh dimension that splits a matrix dimension with a plain `Shard` (FSDP, expert FSDP,
HSDP's shard groups):

1. every rank sends its shard of each matrix to the matrix's owner, all matrices in one
   `all_to_all_single` (the pieces for one owner back to back, in plan order);
2. the owner puts the pieces where `Shard` put them (`torch.chunk`'s split of that dimension),
   runs Newton-Schulz on the whole matrix,
3. and one more `all_to_all_single` hands every rank its slice of each result.

So a rank sends each of its pieces once (none to itself) and each owner sends each result once
less its own slice: half of what the all-gather path sends on two ranks, and two calls per wave
(below) instead of two per round. The values are the same: the whole matrix is assembled from the same
pieces and Newton-Schulz runs on it in the same precision (tests/test_muon.py, the layout tests).

Chunks: the exchange goes in chunks of at most `EXCHANGE_BYTES` of this rank's pieces (by the
matrices' global sizes, so every rank cuts the same chunks), which bounds the optimizer step's
working set (each chunk's updates, send and receive buffers and assembled matrices) to a few
times that, whatever the model's size.

Waves: each chunk is cut into up to `WAVES` consecutive waves of about equal bytes (`cut_waves`),
each with its own two all-to-alls, issued asynchronously (on gloo's threads on a CPU): every
wave's pieces leave at once, then each wave is orthogonalised as its pieces land and its results
leave while the next wave computes. Only the first wave's pieces and the last one's results
travel while nothing computes, about 2 / `WAVES` of the bytes; the values are the same (the same
matrices, assembled from the same pieces). The buffers alive stay about two chunks' worth (the
pieces not yet orthogonalised, sent and received, and the results sent and returned), as
`trinity-train plan` counts them.

Layouts this does not cover (a matrix split over two mesh dimensions, FSDP's `_StridedShard`
on top of TP, a matrix replicated over a gather dimension) keep the round-by-round path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from trinity_train.optim.newton_schulz import newton_schulz

EXCHANGE_BYTES = 64 << 20  # per rank and chunk: a handful of calls a step, a bounded working set
WAVES = 4  # per chunk: pipelined exchanges, so that all but about 2 / WAVES of the bytes travel during compute


def packed_dim(mesh: DeviceMesh | None, placements: tuple, gather_dims: tuple[int, ...], ndim: int) -> int | None:
    """The tensor dimension the one gather mesh-dimension splits with a plain `Shard`, when this
    layout can take the packed exchange; None otherwise."""
    if mesh is None or len(gather_dims) != 1:
        return None
    placement = placements[gather_dims[0]]
    if type(placement) is not Shard:  # _StridedShard and Replicate keep DTensor's path
        return None
    dim = placement.dim if placement.dim >= 0 else placement.dim + ndim
    return dim if dim in (ndim - 2, ndim - 1) else None


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece `index` when `torch.chunk` splits `size` into `parts`, as
    DTensor's `Shard` does (the last pieces may be short or empty)."""
    step = math.ceil(size / parts) if size else 0
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def cut_chunks(sizes: list[float]) -> list[list[int]]:
    """Indices of `sizes` (bytes of a rank's piece of each matrix, in exchange order) cut into
    consecutive chunks of at most `EXCHANGE_BYTES` (a larger piece is a chunk of its own). The one
    rule for the exchange and for `trinity-train plan`'s count of its calls."""
    chunks: list[list[int]] = [[]]
    used = 0.0
    for i, size in enumerate(sizes):
        if chunks[-1] and used + size > EXCHANGE_BYTES:
            chunks.append([])
            used = 0.0
        chunks[-1].append(i)
        used += size
    return chunks


def cut_waves(sizes: list[float]) -> list[list[int]]:
    """Indices of a chunk's `sizes` (as `cut_chunks` takes them) cut into at most `WAVES`
    consecutive waves of about equal bytes, none empty. The one rule for the exchange and for
    `trinity-train plan`'s count of its calls (two a wave)."""
    total = sum(sizes)
    waves: list[list[int]] = [[]]
    used = 0.0
    for i, size in enumerate(sizes):
        if waves[-1] and len(waves) < WAVES and used >= total * len(waves) / WAVES:
            waves.append([])
        waves[-1].append(i)
        used += size
    return [w for w in waves if w]


def exchange_calls(sizes: list[float]) -> int:
    """The all-to-alls an exchange of pieces of `sizes` makes: two a wave of each chunk."""
    return 2 * sum(len(cut_waves([sizes[i] for i in chunk])) for chunk in cut_chunks(sizes))


def piece_shape(local_shape: torch.Size, dim: int, size: int, n: int, t: int) -> list[int]:
    """The shape of rank t's piece of a matrix whose split dim `dim` has `size` elements: this rank's
    shape with t's span of that dim (the group's ranks share every other extent)."""
    shape = list(local_shape)
    shape[dim] = chunk_span(size, n, t)[1]
    return shape


@dataclass
class Assignment:
    """One matrix (or expert stack) of the step: who owns it and how this rank holds it."""

    param: torch.Tensor
    group: dict
    owner: int  # the slot (rank of the gather group) that orthogonalises it
    dim: int  # the tensor dimension the group splits
    steps: int  # Newton-Schulz iterations


@dataclass
class Exchange:
    """The matrices of one gather group and Newton-Schulz precision, exchanged together."""

    mesh: DeviceMesh
    mesh_dim: int
    dtype: torch.dtype
    members: list[Assignment]

    def run(self, update_of: Callable[[Assignment], torch.Tensor],
            apply: Callable[[Assignment, torch.Tensor], None],
            after_send: Callable[[], None] = lambda: None) -> None:
        """Orthogonalise every member's update: `update_of(a)` gives this rank's shard of it (in
        `dtype`), `apply(a, shard)` takes this rank's shard of the result. `after_send()` runs once,
        when the first chunk's pieces are on their way and before any Newton-Schulz."""
        n = self.mesh.size(self.mesh_dim)
        for i, chunk in enumerate(self._chunks(n)):
            self._run_chunk(chunk, n, update_of, apply, after_send if i == 0 else (lambda: None))

    def _chunks(self, n: int) -> list[list[Assignment]]:
        # By the matrices' global sizes, so every rank cuts the same chunks.
        size = torch.empty((), dtype=self.dtype).element_size()
        pieces = [a.param.numel() * size / n for a in self.members]
        return [[self.members[i] for i in chunk] for chunk in cut_chunks(pieces)]

    def _run_chunk(self, chunk: list[Assignment], n: int, update_of, apply, after_send) -> None:
        group = self.mesh.get_group(self.mesh_dim)
        me = self.mesh.get_local_rank(self.mesh_dim)
        size = torch.empty((), dtype=self.dtype).element_size()
        waves = [[chunk[i] for i in wave] for wave in cut_waves([a.param.numel() * size / n for a in chunk])]
        # 1. Every wave's pieces on their way to the owners before the first is waited for.
        sent = [_Wave(wave, n, me, self.dtype, update_of).send(group) for wave in waves]
        after_send()
        # 2. Each wave's matrices orthogonalised as its pieces land, their results sent home at
        #    once: the next wave's pieces and this one's results travel while the next computes.
        for wave in sent:
            wave.orthogonalise_and_return(group)
        # 3. Every rank's slices of the results, applied.
        for wave in sent:
            wave.apply_returned(apply)


class _Wave:
    """One wave of a chunk: its members' pieces sent to their owners, orthogonalised there, and
    every rank's slice of each result sent back, each all-to-all issued asynchronously and waited
    only where its data is needed."""

    def __init__(self, members: list[Assignment], n: int, me: int, dtype: torch.dtype, update_of):
        self.n, self.dtype = n, dtype
        self.by_owner = [[a for a in members if a.owner == t] for t in range(n)]
        self.mine = self.by_owner[me]
        updates = {id(a): update_of(a) for a in members}
        self.send_buffer = torch.cat([updates[id(a)].reshape(-1) for t in range(n) for a in self.by_owner[t]])
        self.send_splits = [sum(updates[id(a)].numel() for a in self.by_owner[t]) for t in range(n)]
        self.local_shape = {id(a): updates[id(a)].shape for a in members}
        self.piece_shapes = {(id(a), t): piece_shape(self.local_shape[id(a)], a.dim, a.param.shape[a.dim], n, t)
                             for a in self.mine for t in range(n)}
        self.piece_numel = {key: math.prod(shape) for key, shape in self.piece_shapes.items()}
        self.recv_splits = [sum(self.piece_numel[(id(a), t)] for a in self.mine) for t in range(n)]

    def send(self, group) -> _Wave:
        """My piece of every matrix to its owner (my own matrices' pieces stay local)."""
        self.received = self.send_buffer.new_empty(sum(self.recv_splits))
        self.work = dist.all_to_all_single(self.received, self.send_buffer, self.recv_splits, self.send_splits,
                                           group=group, async_op=True)
        return self

    def orthogonalise_and_return(self, group) -> None:
        """Assemble and orthogonalise the matrices I own; every rank's slice of each result back
        to it (an owner of nothing sends nothing)."""
        n = self.n
        self.work.wait()
        del self.send_buffer
        pieces = _split(self.received, self.recv_splits,
                        [[self.piece_numel[(id(a), t)] for a in self.mine] for t in range(n)])
        results = []
        for i, a in enumerate(self.mine):
            parts = [pieces[t][i].view(self.piece_shapes[(id(a), t)]) for t in range(n)]
            results.append(newton_schulz(torch.cat(parts, dim=a.dim), a.steps, self.dtype))
        like = self.received[:0]
        del pieces, self.received
        self.back = torch.cat([r.narrow(a.dim, *chunk_span(a.param.shape[a.dim], n, t)).reshape(-1)
                               for t in range(n) for a, r in zip(self.mine, results)] or [like])
        back_splits = [sum(self.piece_numel[(id(a), t)] for a in self.mine) for t in range(n)]
        self.returned = self.back.new_empty(sum(self.send_splits))
        self.work = dist.all_to_all_single(self.returned, self.back, self.send_splits, back_splits,
                                           group=group, async_op=True)

    def apply_returned(self, apply) -> None:
        self.work.wait()
        del self.back
        mine_back = _split(self.returned, self.send_splits,
                           [[math.prod(self.local_shape[id(a)]) for a in self.by_owner[t]] for t in range(self.n)])
        for t in range(self.n):
            for a, flat in zip(self.by_owner[t], mine_back[t]):
                apply(a, flat.view(self.local_shape[id(a)]))
        del self.returned


def _split(flat: torch.Tensor, segments: list[int], sizes: list[list[int]]) -> list[list[torch.Tensor]]:
    """`flat` cut into its per-rank segments, each cut into its pieces."""
    out = []
    for segment, piece_sizes in zip(flat.split(segments), sizes):
        out.append(list(segment.split(piece_sizes)) if piece_sizes else [])
    return out
