"""Distributed Muon: whole-matrix Newton-Schulz on sharded DTensors, work spread over ranks.

One optimizer object holds two kinds of parameter groups (`group["kind"]`):

- `"muon"`: hidden matrices (2-D) and routed-expert stacks `[E, out, in]` (one matrix per expert).
  Nesterov momentum as in `torch.optim.Muon`, then Newton-Schulz on the *whole logical* matrix,
  decoupled weight decay, and an update scale computed from the global shape.
- `"adamw"`: everything else, stepped with torch's own functional AdamW (its fused kernel when
  the group says `fused=True`).

Parameters may be plain tensors or DTensors in any layout FSDP2, TP and EP produce (`Shard`,
FSDP's `_StridedShard`, `Replicate`, on 1-D to 4-D meshes). For a DTensor, the mesh dimensions
split into two sets:

- *batch* dims shard the expert dimension: every rank already holds whole matrices, so those
  matrices are orthogonalised where they are, with no communication;
- *gather* dims shard a matrix dimension, or replicate the tensor: the matrix must be assembled
  on one rank of the gather group before Newton-Schulz can run;
- *replica* dims (`REPLICA_DIMS`: HSDP's `dp_replicate`) replicate the tensor across replica
  groups that each run the whole step: every replica group orthogonalises the same matrices on
  the same inputs, so nothing crosses them. Gathering over them too would split the work further
  but send every round's stack (sized by the group: 512 slots for 64 x 8 ranks, mostly zeros)
  across nodes: `trinity-train plan` measured 5.2 GB a step across nodes for nano on 512 ranks.

FSDP shards routed experts along the expert dim where they split evenly (a batch dim) and along
dim 1, a matrix dim, where they do not (`parallel.mesh.expert_shard_dim`): then its dim is a
gather dim like TP's, and a rank's expert stack is assembled whole before Newton-Schulz.

Matrices are dealt to the ranks of their gather group largest first, each to the rank with
the least Newton-Schulz work so far (round-robin while loads tie), so the work is balanced and
nobody repeats anybody's work. Matrices of one layout and shape then go in rounds of at most one
per rank: a round stacks n updates (n = the gather group's size; zeros where a rank has nothing
this round) into one DTensor `[n, ...]` and redistributes it so that the stacked dim is sharded
over the gather dims. Each rank then holds one whole matrix (an all-to-all done by DTensor),
orthogonalises it, and the reverse redistribution hands every rank its shard of every result.
The plan depends only on the parameters' shapes and layouts, so every rank issues the same
collectives in the same order; a parameter without a gradient (an expert that received no
tokens) takes part with a zero gradient.

State is stored per parameter with the parameter's own layout, so
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` keys it by parameter name and
DCP reshards it when the parallel layout changes.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim.adam import adam
from torch.utils.hooks import RemovableHandle

from trinity_train.kernel_device import kernel_device
from trinity_train.optim.muon_exchange import Assignment, Exchange, packed_dim
from trinity_train.optim.newton_schulz import newton_schulz

SCALES = ("spectral", "rms_match")
NS_DTYPES = ("auto", "bf16", "fp32")
KINDS = ("muon", "adamw")


def update_scale(scale: str, shape: torch.Size | tuple[int, ...]) -> float:
    """Factor on the learning rate for an orthogonalised update of a `[..., fan_out, fan_in]` weight.

    `spectral` (Trinity, Keller Jordan): sqrt(max(1, fan_out / fan_in)), an update of unit
    spectral norm per unit of lr. `rms_match` (Moonlight): 0.2 * sqrt(max(fan_out, fan_in)), an
    update whose RMS matches AdamW's, so AdamW's learning rate carries over.
    """
    fan_out, fan_in = shape[-2], shape[-1]
    if scale == "spectral":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if scale == "rms_match":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    raise ValueError(f"unknown Muon update scale {scale!r}; expected one of {SCALES}")


def ns_dtype_for(name: str, p: torch.Tensor) -> torch.dtype:
    """Newton-Schulz working precision for parameter `p`: bf16 on GPUs (it is stable there and
    twice as fast); a planner's fake CPU tensors that stand for a GPU's count as on the GPU."""
    if name == "auto":
        return torch.bfloat16 if kernel_device(p) == "cuda" else torch.float32
    return torch.bfloat16 if name == "bf16" else torch.float32


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (D)Tensor; in-place edits of it edit the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _grad_like_param(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient in the parameter's own layout (TP can leave a replicated weight's grad Partial)."""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g


def _shard_dim(placement: Placement) -> int | None:
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


# Mesh dims whose replicas each run the whole optimizer step (see the module doc).
REPLICA_DIMS = ("dp_replicate",)


@dataclass(frozen=True)
class _Layout:
    """How one parameter's matrices are spread over ranks, and who must gather what."""

    mesh: DeviceMesh | None  # None: a plain tensor, whole on this rank
    placements: tuple[Placement, ...]
    gather_dims: tuple[int, ...]  # mesh dims over which a matrix is split or replicated

    @staticmethod
    def of(p: torch.Tensor) -> _Layout:
        if not isinstance(p, DTensor):
            return _Layout(None, (), ())
        matrix_dims = (p.ndim - 2, p.ndim - 1)
        names = p.device_mesh.mesh_dim_names or ()
        gather = []
        for i, placement in enumerate(p.placements):
            dim = _shard_dim(placement)
            if placement.is_partial():
                raise ValueError(f"Muon got a parameter with a Partial placement ({p.placements})")
            if dim is None and i < len(names) and names[i] in REPLICA_DIMS:
                continue
            if dim is None or dim in matrix_dims:
                gather.append(i)
        return _Layout(p.device_mesh, tuple(p.placements), tuple(gather))

    @property
    def group_size(self) -> int:
        return math.prod(self.mesh.size(i) for i in self.gather_dims) if self.mesh is not None else 1

    def my_slot(self) -> int:
        """This rank's index along the gather dims, flattened in mesh order as DTensor nests them."""
        coord = self.mesh.get_coordinate()
        slot = 0
        for i in self.gather_dims:
            slot = slot * self.mesh.size(i) + coord[i]
        return slot


class Muon(torch.optim.Optimizer):
    """Muon for groups with `kind="muon"`, AdamW for groups with `kind="adamw"` (see module doc).

    Muon options per group: lr, weight_decay, momentum, nesterov, ns_steps, scale
    ("spectral" | "rms_match"), ns_dtype ("auto" | "bf16" | "fp32"). AdamW options per group:
    lr, betas, eps, weight_decay, fused (None: torch's default implementation).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 scale: str = "spectral", ns_dtype: str = "auto",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 fused: bool | None = None):
        defaults = dict(kind="muon", lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, scale=scale, ns_dtype=ns_dtype,
                        betas=betas, eps=eps, fused=fused)
        super().__init__(params, defaults)
        self._while_orthogonalising: OrderedDict[int, Callable[[], None]] = OrderedDict()  # (RemovableHandle needs a weak-referenceable dict)

    def register_while_orthogonalising_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run `hook()` once in every step, when the AdamW groups' parameters are final and the
        first packed exchange's pieces have left (right after the AdamW part where no packed
        exchange runs): what it sends travels behind Muon's pieces while Newton-Schulz computes,
        instead of ahead of them (a CPU job issues the next forward's first all-gathers there:
        parallel/gloo). As torch's other optimizer hooks, `handle.remove()` removes it."""
        handle = RemovableHandle(self._while_orthogonalising)
        self._while_orthogonalising[handle.id] = hook
        return handle

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["kind"] not in KINDS:
            raise ValueError(f"param group kind must be one of {KINDS}, got {group['kind']!r}")
        if group["kind"] != "muon":
            return
        if group["scale"] not in SCALES:
            raise ValueError(f"Muon scale must be one of {SCALES}, got {group['scale']!r}")
        if group["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"Muon ns_dtype must be one of {NS_DTYPES}, got {group['ns_dtype']!r}")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {group['momentum']}")
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(f"Muon takes matrices or expert stacks, got a parameter of "
                                 f"shape {tuple(p.shape)}; put it in an 'adamw' group")

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group. The matrices whole on this rank are orthogonalised while the
        first packed exchange's pieces travel, after the hooks that run there
        (`register_while_orthogonalising_hook`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
        self._muon_step([g for g in self.param_groups if g["kind"] == "muon"])
        return loss

    # ------------------------------------------------------------------------------ AdamW

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # torch.optim.Adam's placement: on the CPU, unless the fused kernel needs it
                # next to the parameter.
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=_local(p).device if group["fused"] else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            # Elementwise math needs no collectives: run it on the local shards.
            params.append(_local(p))
            grads.append(_local(_grad_like_param(p)))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
             fused=group["fused"])

    # ------------------------------------------------------------------------------- Muon

    def _muon_step(self, groups: list[dict]) -> None:
        # Matrices that share a layout, shape and Newton-Schulz setting can share rounds.
        buckets: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}
        for group in groups:
            for p in group["params"]:
                layout = _Layout.of(p)
                dtype = ns_dtype_for(group["ns_dtype"], p)
                key = (layout, tuple(p.shape), dtype, group["ns_steps"])
                buckets.setdefault(key, []).append((p, group))
        # Largest first, each matrix to the least-loaded rank of its gather group (the classic
        # greedy). Loads depend only on shapes and layouts, so every rank computes the same plan.
        loads: dict[tuple, list[int]] = {}
        exchanges: dict[tuple, Exchange] = {}
        rounds: list[tuple[_Layout, list[tuple[torch.Tensor, dict]], list[int], torch.dtype, int]] = []
        for key in sorted(buckets, key=lambda k: -ns_cost(k[1])):
            layout, shape, dtype, steps = key
            members = buckets[key]
            group_loads = loads.setdefault((layout.mesh, layout.gather_dims), [0] * layout.group_size)
            packed = packed_dim(layout.mesh, layout.placements, layout.gather_dims, len(shape))
            for round_plan in deal_rounds(len(members), ns_cost(shape), group_loads):
                if packed is not None and layout.group_size > 1:
                    exchange = exchanges.setdefault((layout.mesh, layout.gather_dims, dtype), Exchange(
                        layout.mesh, layout.gather_dims[0], dtype, []))
                    exchange.members += [Assignment(*members[i], slot, packed, steps) for i, slot in round_plan]
                else:
                    rounds.append((layout, [members[i] for i, _ in round_plan], [slot for _, slot in round_plan],
                                   dtype, steps))

        def run_rounds(local: bool) -> None:
            for layout, round_members, slots, dtype, steps in rounds:
                if (layout.group_size == 1) != local:
                    continue
                updates = [self._nesterov_update(p, group, dtype) for p, group in round_members]
                if local:
                    ortho = [newton_schulz(u, steps, dtype) for u in updates]
                else:
                    ortho = _orthogonalise_round(layout, [p for p, _ in round_members], updates, slots, steps, dtype)
                for (p, group), o in zip(round_members, ortho):
                    _apply_update(p, group, o)

        def meanwhile() -> None:
            """While the first exchange's pieces travel: the hooks, then the matrices no rank
            shares (whole on this rank: expert stacks under EP), which need no collective."""
            for hook in list(self._while_orthogonalising.values()):
                hook()
            run_rounds(local=True)

        run_rounds(local=False)  # the round-by-round exchanges block: before any packed one is in flight
        if not exchanges:
            meanwhile()
        for i, exchange in enumerate(exchanges.values()):
            exchange.run(lambda a: self._nesterov_update(a.param, a.group, exchange.dtype),
                         lambda a, o: _apply_update(a.param, a.group, o),
                         after_send=meanwhile if i == 0 else (lambda: None))

    def _nesterov_update(self, p: torch.Tensor, group: dict, dtype: torch.dtype) -> torch.Tensor:
        """Advance the momentum buffer; return this rank's shard of the update to orthogonalise."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = _local(state["momentum_buffer"])
        g = _grad_like_param(p)
        # No gradient (e.g. an expert that got no tokens): a zero gradient, so the collectives
        # of its round still happen on every rank.
        g = torch.zeros_like(buf) if g is None else _local(g)
        momentum = group["momentum"]
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        return update.to(dtype)


def deal_rounds(count: int, cost: int, loads: list[int]) -> list[list[tuple[int, int]]]:
    """Give each of `count` equal matrices to the least-loaded slot (updating `loads`).

    Returns rounds of (matrix index, slot) with at most one matrix per slot: round r holds the
    r-th matrix of every slot that got more than r.
    """
    per_slot: list[list[int]] = [[] for _ in loads]
    # A heap of (load, slot): the least-loaded slot, the lowest on ties, in log time (a plan's
    # layout search deals the matrices of thousands of candidate layouts over up to 2,048 slots).
    heap = [(load, j) for j, load in enumerate(loads)]
    heapq.heapify(heap)
    for i in range(count):
        load, slot = heapq.heappop(heap)
        loads[slot] = load + cost
        per_slot[slot].append(i)
        heapq.heappush(heap, (loads[slot], slot))
    rounds = max(len(q) for q in per_slot)
    return [[(q[r], slot) for slot, q in enumerate(per_slot) if r < len(q)] for r in range(rounds)]


def _orthogonalise_round(layout: _Layout, params: list[torch.Tensor], updates: list[torch.Tensor],
                         slots: list[int], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz on up to n sharded matrices, each on one rank of the gather group.

    Returns each matrix's result as this rank's shard, in the parameter's layout.
    """
    n = layout.group_size
    pieces = [DTensor.from_local(u, layout.mesh, layout.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
              for p, u in zip(params, updates)]
    stack = [torch.zeros_like(pieces[0])] * n
    for slot, piece in zip(slots, pieces):
        stack[slot] = piece
    stacked = torch.stack(stack)  # [n, *shape]; the param's placements shift by one dim
    owner_placements = list(stacked.placements)
    for i in layout.gather_dims:
        owner_placements[i] = Shard(0)
    owned = stacked.redistribute(layout.mesh, owner_placements)
    local = owned.to_local()  # [1, ...]: one whole matrix (or expert stack) per rank
    if layout.my_slot() in slots:
        local = newton_schulz(local, steps, dtype)
    result = DTensor.from_local(local, layout.mesh, owner_placements, run_check=False,
                                shape=stacked.shape, stride=stacked.stride())
    shards = result.redistribute(layout.mesh, stacked.placements).to_local()
    return [shards[slot] for slot in slots]


def ns_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz work on a `[..., rows, cols]` weight, up to a constant factor."""
    small, large = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * small * small * large + small ** 3)


def _apply_update(p: torch.Tensor, group: dict, ortho: torch.Tensor) -> None:
    lr = group["lr"]
    param = _local(p)
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-lr * update_scale(group["scale"], p.shape))
