"""Forward hooks that gather the activation sums of the layer statistics, only while armed, and
the one reduction that makes them global.

Hooked, in every block (`model/blocks.py`):

| site        | module                  | what it adds                                           |
|-------------|-------------------------|--------------------------------------------------------|
| `block`     | the block               | power sums, histogram of |x| and max |x| of its output |
| `attn`      | `attn`                  | n and sum(x^2) of the attention output                 |
| `attn_post` | `attn_post_norm`        | the same after the post norm (absent without one)      |
| `ffn`       | `mlp`                   | n and sum(x^2) of the FFN / MoE output                 |
| `ffn_post`  | `mlp_post_norm`         | the same after the post norm (absent without one)      |
| `router`    | `mlp.router` (MoE only) | tokens and summed entropy of the normalised scores     |

Arming registers the hooks for one forward and removes them after it, so nothing else ever
runs them: not the forwards activation checkpointing repeats inside backward (those would count
twice), not validation, not the other iterations (which pay nothing). A compiled block would not
run hooks added after it was compiled (dynamo skips hook guards), and hooks present while it
compiles would be traced into it; so an armed forward runs the blocks eagerly
(`torch.compiler.set_stance("force_eager")`), and the compiled code is used again, unchanged and
without recompiling, by the next forward.

Sums stay on this rank until `reduce_sites`: a tensor-parallel activation is a DTensor split
along the sequence, so its local sums are summed (maxima maxed) over the mesh dims it is sharded
on; plain tensors (one process, FSDP, EP, and the router, which runs replicated under TP) are
whole on the rank. Then everything is summed (maxed) over the data-parallel ranks: one
collective per kind and layout, once per statistics step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from trinity_train.model.blocks import TransformerBlock
from trinity_train.observe import activation_sums as sums
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.reductions import max_over_data_parallel, sum_over_data_parallel

# How the sums of one tensor combine over the ranks of its mesh: (mesh, sharded per mesh dim);
# None for a plain tensor, which is whole on this rank.
Layout = tuple[DeviceMesh, tuple[bool, ...]] | None


def local_view(x: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """This rank's part of `x` and how its sums combine over ranks."""
    if not isinstance(x, DTensor):
        return x, None
    if any(p.is_partial() for p in x.placements):  # pending sums: statistics need the values
        x = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    return x.to_local(), (x.device_mesh, tuple(p.is_shard() for p in x.placements))


@dataclass
class SiteSums:
    """What one hooked site accumulated over the armed forwards of a step."""

    num_sums: int
    num_maxima: int
    sums: torch.Tensor | None = None  # float64 [num_sums]
    maxima: torch.Tensor | None = None  # float64 [num_maxima]
    layout: Layout = None
    forwards: int = 0  # armed forwards that reached this site

    def add(self, values: torch.Tensor, maxima: torch.Tensor | None, layout: Layout) -> None:
        if self.forwards and layout != self.layout:
            raise RuntimeError(f"a hooked activation changed its layout within a step: {self.layout} -> {layout}")
        self.layout = layout
        self.sums = values if self.sums is None else self.sums + values
        if maxima is not None:
            self.maxima = maxima if self.maxima is None else torch.maximum(self.maxima, maxima)
        self.forwards += 1

    def fill(self, device: torch.device) -> None:
        """Zeros where the site saw nothing, so every rank reduces vectors of the same sizes."""
        if self.sums is None:
            self.sums = torch.zeros(self.num_sums, dtype=torch.float64, device=device)
        if self.maxima is None:
            self.maxima = torch.zeros(self.num_maxima, dtype=torch.float64, device=device)


def _output_tensor(output):
    """The activation of a module's output: the first element of (out, aux) tuples."""
    return output[0] if isinstance(output, tuple) else output


# What a module's output contributes: (sums, maxima or None, layout).


def _block_output(output):
    local, layout = local_view(_output_tensor(output))
    return torch.cat([sums.power_sums(local), sums.magnitude_histogram(local)]), sums.abs_max(local), layout


def _square_sums(output):
    local, layout = local_view(_output_tensor(output))
    return sums.square_sums(local), None, layout


def _router(routing):
    local, layout = local_view(routing.scores)
    return sums.router_entropy_sums(local), None, layout


BLOCK_SUMS = sums.NUM_POWER_SUMS + sums.HISTOGRAM_BINS
# site: (its module in a block, or None; what the module's output contributes; sums; maxima)
SITES: dict[str, tuple[Callable[[TransformerBlock], nn.Module | None], Callable, int, int]] = {
    "block": (lambda b: b, _block_output, BLOCK_SUMS, 1),
    "attn": (lambda b: b.attn, _square_sums, 2, 0),
    "attn_post": (lambda b: b.attn_post_norm, _square_sums, 2, 0),
    "ffn": (lambda b: b.mlp, _square_sums, 2, 0),
    "ffn_post": (lambda b: b.mlp_post_norm, _square_sums, 2, 0),
    "router": (lambda b: b.mlp.router if b.is_moe else None, _router, 2, 0),
}


@dataclass
class ActivationHooks:
    """The hooked sites of every block and what they gathered since the last `take`."""

    blocks: list[TransformerBlock]
    device: torch.device
    sites: dict[tuple[int, str], SiteSums] = field(init=False)

    def __post_init__(self):
        self._reset()

    def _reset(self) -> None:
        self.sites = {}
        for i, block in enumerate(self.blocks):
            for name, (module_of, _, num_sums, num_maxima) in SITES.items():
                if module_of(block) is not None:
                    self.sites[(i, name)] = SiteSums(num_sums, num_maxima)

    def _hook(self, key: tuple[int, str]):
        measure = SITES[key[1]][1]
        site = self.sites[key]

        def record(_module, _inputs, output):
            with torch.no_grad():
                site.add(*measure(output))

        return record

    @contextlib.contextmanager
    def armed(self):
        """Record the forwards run inside this context (eagerly, see the module docstring)."""
        handles = [SITES[name][0](self.blocks[i]).register_forward_hook(self._hook((i, name)))
                   for i, name in self.sites]
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def forwards(self) -> int:
        """Armed forwards recorded since the last `take` (each block output counts once per forward)."""
        return min((s.forwards for (_, name), s in self.sites.items() if name == "block"), default=0)

    def take(self, dims: ParallelDims) -> dict[tuple[int, str], tuple[list[float], list[float]]]:
        """The global (sums, maxima) of every site, over micro-batches and ranks; starts afresh.
        Every rank must call this (it holds the collectives)."""
        sites = list(self.sites.values())
        for site in sites:
            site.fill(self.device)
        reduce_sites(sites, dims)
        taken = {key: (s.sums.tolist(), s.maxima.tolist()) for key, s in self.sites.items()}
        self._reset()
        return taken


def _over_mesh(values: torch.Tensor, layout: Layout, reduce_op: str) -> torch.Tensor:
    """Combine per-rank sums (or maxima) over the mesh dims the tensors were sharded on."""
    mesh, sharded = layout
    placements = [Partial(reduce_op) if s else Replicate() for s in sharded]
    return DTensor.from_local(values, mesh, placements, run_check=False).full_tensor()


def reduce_sites(sites: list[SiteSums], dims: ParallelDims) -> None:
    """In place, make every site's (filled) sums and maxima global: first over the ranks that
    split its tensors (one collective per layout and kind), then over the data-parallel ranks
    (one sum and one max). The identity in one process."""
    by_layout: dict[Layout, list[SiteSums]] = {}
    for site in sites:
        by_layout.setdefault(site.layout, []).append(site)
    for layout, members in by_layout.items():
        if layout is None:
            continue
        _assign(members, "sums", _over_mesh(torch.cat([s.sums for s in members]), layout, "sum"))
        _assign(members, "maxima", _over_mesh(torch.cat([s.maxima for s in members]), layout, "max"))
    _assign(sites, "sums", sum_over_data_parallel(torch.cat([s.sums for s in sites]), dims))
    _assign(sites, "maxima", max_over_data_parallel(torch.cat([s.maxima for s in sites]), dims))


def _assign(sites: list[SiteSums], name: str, values: torch.Tensor) -> None:
    """Hand the pieces of a concatenated vector back to the sites they came from."""
    pieces = values.split([getattr(s, name).numel() for s in sites])
    for site, piece in zip(sites, pieces):
        setattr(site, name, piece)
