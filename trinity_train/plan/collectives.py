"""What one rank sends in each collective: the one rule the planner's traces and the benchmarks'
counters share (`trinity-train plan`, benchmarks/multinode.py).

A collective is credited with the payload this rank puts on the links under the textbook
algorithms: all-gather its shard x (n-1); reduce-scatter (n-1)/n of its input; all-reduce
2(n-1)/n of the tensor (ring); all-to-all the rows meant for the other ranks; broadcast the
tensor x (n-1) from the root. What a backend actually puts on the wire differs by a factor per
kind (gloo builds reduce-scatter from an all-reduce: ~2x, so FSDP's on gloo is an all-to-all of
the shards, `parallel/gloo/reduce_scatter.py`, filed under FSDP reduce-scatter with its own
bytes, the same (n-1)/n; benchmarks/multinode.py calibrates the factors).

Each call is also named by *who* issued it (FSDP, the EP dispatch, Muon, other) from the Python
stack, and by the process group it ran on (its ranks, so a planner can tell whether it crosses
nodes, and a mesh-dimension name where the caller supplies them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

FSDP_ALL_GATHER = "FSDP all-gather"
FSDP_REDUCE_SCATTER = "FSDP reduce-scatter"
# A CPU job's embedding: the rows its forward reads (parallel/gloo/embedding_all_gather.py) and the rows its
# tokens touched (parallel/gloo/embedding_reduce_scatter.py); data-dependent, so the planner counts the whole
# table, an upper bound.
FSDP_EMBEDDING_ROWS_GATHER = "FSDP all-gather, embedding rows"
FSDP_EMBEDDING_ROWS_REDUCE = "FSDP reduce-scatter, embedding rows"
FSDP_ALL_REDUCE = "FSDP all-reduce"  # HSDP: across the replica groups
EP_ALL_TO_ALL = "EP all-to-all"
MUON_REDISTRIBUTE = "Muon redistribute"
# Context parallelism's collectives (parallel/context_parallel.py), forward and backward.
CP_CATEGORY = {"all_to_all": "CP halo all-to-all", "all_gather": "CP key/value all-gather",
               "reduce_scatter": "CP key/value reduce-scatter", "all_reduce": "CP loss all-reduce"}


def nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return 0


def process_group(value) -> dist.ProcessGroup:
    """The process group behind a c10d op's group argument (a group name or a boxed group)."""
    if isinstance(value, str):
        return _resolve_process_group(value)
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value)
    return value


def sent_bytes(name: str, a: dict, n: int, me: int) -> tuple[str, float] | None:
    """(kind, bytes this rank sends) of the c10d op `name` with arguments `a` on a group of `n`
    ranks where this rank is `me`; None for an op that is not a collective (waits, barriers)."""
    if name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return "all_gather", nbytes(a.get("input_tensor", a.get("input_tensors", a.get("inputs")))) * (n - 1)
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"):
        return "all_gather", nbytes(a.get("input", a.get("inputs"))) * (n - 1)
    if name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return "reduce_scatter", nbytes(a.get("input_tensor", a.get("input_tensors", a.get("inputs")))) * (n - 1) / n
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out"):
        return "reduce_scatter", nbytes(a.get("input", a.get("inputs"))) * (n - 1) / n
    if name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                "all_reduce_coalesced_"):
        return "all_reduce", nbytes(a.get("tensors", a.get("input", a.get("inputs")))) * 2 * (n - 1) / n
    if name in ("alltoall_base_", "all_to_all_single"):
        tensor = a.get("input")
        splits = a.get("input_split_sizes") or [tensor.shape[0] // n] * n
        row = tensor.element_size() * (tensor[0].numel() if tensor.shape[0] else 0)
        return "all_to_all", sum(int(s) for r, s in enumerate(splits) if r != me) * row
    if name == "shard_dim_alltoall":  # DTensor's redistribute between two shardings (NCCL path)
        return "all_to_all", nbytes(a.get("input")) * (n - 1) / n
    if name in ("broadcast_", "broadcast"):
        src = a.get("root_rank", a.get("src"))
        return "broadcast", nbytes(a.get("tensors", a.get("input"))) * (n - 1) if src == me else 0
    if name == "send":
        return "send", nbytes(a.get("tensors"))
    return None


def category(kind: str, frames: list[str]) -> str:
    """Who issued a collective of `kind`, from the file names on the Python stack."""
    # (both embedding collectives call row_exchange.py's all-to-alls)
    if any(f.endswith("parallel/gloo/embedding_all_gather.py") for f in frames):
        return FSDP_EMBEDDING_ROWS_GATHER
    if any(f.endswith("parallel/gloo/embedding_reduce_scatter.py") for f in frames):
        return FSDP_EMBEDDING_ROWS_REDUCE
    # FSDP's reduce-scatter on gloo; an overlapped one may be started from an autograd hook
    # (parallel/gloo/ep_backward_hold.py), with no FSDP frame on the stack.
    if kind == "all_to_all" and any(f.endswith("parallel/gloo/reduce_scatter.py") for f in frames):
        return FSDP_REDUCE_SCATTER
    if any("/torch/distributed/fsdp/" in f for f in frames):
        if kind == "all_gather":
            return FSDP_ALL_GATHER
        if kind in ("reduce_scatter", "all_to_all"):  # on gloo FSDP reduce-scatters by an all-to-all
            return FSDP_REDUCE_SCATTER
        if kind == "all_reduce":
            return FSDP_ALL_REDUCE
        return f"FSDP {kind}"
    if any(f.endswith("optim/muon.py") for f in frames):
        return MUON_REDISTRIBUTE
    if any(f.endswith("parallel/context_parallel.py") for f in frames):
        return CP_CATEGORY.get(kind, f"CP {kind}")
    if kind == "all_to_all":  # the dispatch's forward, or its backward (autograd's frames only)
        return EP_ALL_TO_ALL
    where = next((Path(f).name for f in frames if "/trinity_train/" in f and "/trinity_train/plan/" not in f),
                 "torch")
    return f"other: {kind} ({where})"


@dataclass
class CollectiveCall:
    category: str
    kind: str
    group_ranks: tuple[int, ...]  # global ranks of the group, in group order
    sent: float  # bytes this rank sends
    dim: str | None = None  # the mesh dimension(s) the group spans, where named


@dataclass
class CollectiveLog(TorchDispatchMode):
    """Records every collective this process issues while entered (the dispatch level, so it
    sees FSDP's, DTensor's and the EP dispatch's collectives alike). `dim_of(ranks, category)`
    names a group's mesh dimension (the planner passes one that knows the mesh's groups)."""

    dim_of: Callable[[tuple[int, ...], str], str | None] = lambda ranks, category: None
    calls: list[CollectiveCall] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()
        self._ranks: dict[int, tuple[int, ...]] = {}

    def _group(self, value) -> tuple[int, int, tuple[int, ...]]:
        pg = process_group(value)
        ranks = self._ranks.get(id(pg))
        if ranks is None:
            ranks = self._ranks[id(pg)] = tuple(dist.get_process_group_ranks(pg))
        return pg.size(), pg.rank(), ranks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional", "_dtensor"):
            names = [arg.name for arg in func._schema.arguments]
            a = {**dict(zip(names, args)), **kwargs}
            group = a.get("process_group", a.get("group_name"))
            if group is not None:
                n, me, ranks = self._group(group)
                try:
                    found = sent_bytes(func._schema.name.split("::")[1], a, n, me) if n > 1 else None
                except Exception as e:  # noqa: BLE001 (a call the rule cannot read is shown, never fatal)
                    who = f"uncounted {func} ({type(e).__name__}: {e})"
                    self.calls.append(CollectiveCall(who, "uncounted", ranks, 0, self.dim_of(ranks, who)))
                    found = None
                if found is not None:
                    kind, sent = found
                    who = category(kind, _stack_files())
                    self.calls.append(CollectiveCall(who, kind, ranks, sent, self.dim_of(ranks, who)))
        return out


def sent_by_category(calls) -> dict[str, float]:
    """Bytes sent per category of `CollectiveCall`s (or of anything with `category` and `sent`)."""
    sent: dict[str, float] = {}
    for call in calls:
        sent[call.category] = sent.get(call.category, 0.0) + call.sent
    return sent


def _stack_files() -> list[str]:
    files, frame = [], sys._getframe(2)
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return files
