"""One training iteration of one rank of an N-rank job, traced on fake tensors.

The real code runs: `build_model` on the meta device -> `split_model` (TP, EP) -> the training
wrappers (activation checkpointing; compile is off in a trace) -> `apply_fsdp` (FSDP/HSDP) -> the
real optimizer and scheduler -> `TrainingStep.accumulate_gradients` over the step's micro-batches
-> the global gradient norm -> `TrainingStep.update` (clip, optimizer step with distributed
Muon's plan, expert biases). Only the data is missing: tensors are `FakeTensor`s (shapes, dtypes
and devices, no storage), the process group is torch's fake one (`fake_world`), and the EP
dispatch takes its token counts from a stated routing assumption (`parallel.assumed_routing`).

What is recorded:
- memory: `FSDPMemTracker` (torch.distributed._tools) follows every tensor the iteration makes,
  by category, and keeps the peak; the optimizer state exists before the iteration, as in every
  step of a run after its first (`create_optimizer_state`); the optimizer is the real one with its default per-tensor
  loops (a `foreach` optimizer under fake tensors is mislabelled by the tracker);
- collectives: every call at the dispatch level (`plan.collectives.CollectiveLog`), with the
  group's ranks and mesh dimension;
- only the first two micro-batches of a longer step are traced (`traced_micro_batches`): every
  later one repeats the second's memory (the first finds no sharded gradients yet; FSDP
  reduce-scatters each micro-batch's) and the first's collectives, so the first's calls are
  counted once more for each untraced micro-batch (`repeat_micro_batches`). With the experts
  gathered once a step (`parallel.expert_gather = "step"`) the first micro-batch gathers them and
  the last reduces them, and a CPU job's first micro-batch gathers less than the next ones, so
  there a third is traced and the middle one's calls stand for the untraced.
  A trace costs two or three micro-batches whatever the gradient accumulation; tests check the
  shortcut against a full trace;
- the checkpoint: this rank's share of the model and optimizer state, as DCP writes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor

from trinity_train.config import Config, grad_accum_for
from trinity_train.model import build_model
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler
from trinity_train.parallel.assumed_routing import AssumedRouting, assume_routing
from trinity_train.parallel.context_parallel import shard_micro_batch
from trinity_train.parallel.fsdp import apply_fsdp
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.gloo.communication import install_gloo_communication
from trinity_train.parallel.parallelize import apply_training_wrappers, split_model
from trinity_train.parallel.reductions import global_grad_norm
from trinity_train.plan.collectives import EP_ALL_TO_ALL, CollectiveCall, CollectiveLog
from trinity_train.plan.fake_world import (CpuGroupedMatmul, fake_world, gpu_collectives_and_kernels,
                                          sharding_metadata_apart)
from trinity_train.stability import StepGuard
from trinity_train.step import TrainingStep

# FSDPMemTracker's categories and (one process, no FSDP) MemTracker's -> the plan's.
CATEGORY_OF = {
    "Sharded Param": "parameters", "Buffer": "parameters", "Parameter": "parameters",
    "Unsharded Param": "gathered parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer state", "Optstate": "optimizer state",
    "Activation": "activations", "Inputs": "activations",
    "All Gather": "communication buffers", "Reduce Scatter": "communication buffers",
    "Temp": "temporaries", "Other": "temporaries",  # "Other": what MemTracker cannot attribute
}
CATEGORIES = ("parameters", "gathered parameters", "gradients", "optimizer state", "activations",
              "communication buffers", "temporaries")


# Micro-batches a trace runs; the step's others repeat them (see the module doc).
TRACED_MICRO_BATCHES = 2


def traced_micro_batches(cfg: Config, gpu: bool) -> int:
    """How many of a step's micro-batches a trace runs: two, or three when the first and the last
    differ from those between them: the experts gathered in the first and reduced in the last, or
    a CPU job's all-gathers (its first micro-batch gathers less than the next ones: benchmarks/
    plan_vs_measured.py section 4 measured the two-micro-batch shortcut 16 % short there)."""
    return TRACED_MICRO_BATCHES + (cfg.parallel.expert_gather == "step" or not gpu)


@dataclass
class RankTrace:
    rank: int
    coords: dict[str, int]  # this rank's coordinates in the dense and sparse meshes
    memory: dict[str, int]  # bytes by category at the iteration's peak
    collectives: list[CollectiveCall] = field(repr=False)
    checkpoint_bytes: int  # this rank's share of the model and optimizer state
    local_parameters: int  # parameter elements this rank holds (FSDP padding included)
    seconds: float  # how long the trace took
    micro_batches_traced: int = 0  # of the step's grad_accum (the rest repeat them)

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


def _micro_batch(cfg: Config, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """One micro-batch of this rank's inputs (its share of each row under context parallelism)."""
    rows, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    mb = {"input_ids": torch.zeros(rows, seq, dtype=torch.long), "labels": torch.zeros(rows, seq, dtype=torch.long)}
    if cfg.model.doc_masking:
        mb["document_ids"] = torch.zeros(rows, seq, dtype=torch.long)
        mb["position_ids"] = torch.arange(seq).expand(rows, seq)
    if dims.cp > 1:
        mb = shard_micro_batch(mb, dims.cp, dims.cp_rank, cfg.model.doc_masking)
    return mb


def create_optimizer_state(step: TrainingStep) -> None:
    """Every step of a run but its first starts with the optimizer state alive (the first step
    creates it) and, on a CPU job that prefetches, its first all-gathers in flight (the step before
    issued them), so a traced first iteration would differ: one untraced optimizer step on zero
    gradients does both first, and the traced iteration is a steady-state one."""
    for p in step.params:
        p.grad = torch.zeros_like(p)
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)


def _without_compile(cfg: Config) -> Config:
    """The config a trace runs: compile off (nothing to compile on fake tensors)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))


def _local_numel(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).numel()


def local_bytes(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def mesh_coordinates(dims: ParallelDims) -> dict[str, int]:
    coords = {}
    for view in (dims._dense, dims._sparse):
        for name, c in zip(view.mesh_dim_names, view.get_coordinate()):
            coords[name] = c
    return coords


def group_dim_namer(dims: ParallelDims):
    """A function from a group's ranks to the mesh dimension(s) it spans, for the collectives log:
    "dp_shard", "ep", a flattened "efsdp_ep", ...; where two dimensions are the same ranks (ep = 2
    of dp_shard = 2) the one the caller's category uses (the EP dispatch's "ep")."""
    named: dict[tuple[int, ...], list[str]] = {}

    def add(group, name: str) -> None:
        names = named.setdefault(tuple(dist.get_process_group_ranks(group)), [])
        if name not in names:
            names.append(name)

    for view in (dims._dense, dims._sparse, *([dims._data] if dims.cp > 1 else [])):
        for i, name in enumerate(view.mesh_dim_names):
            if view.size(i) > 1:
                add(view.get_group(i), name)
    for view, flat in dims.flattened_views():
        if view[flat].size() > 1:
            add(view[flat]._flatten("_".join(flat)).get_group(), "_".join(flat))  # the one build_mesh made

    def dim_of(ranks: tuple[int, ...], category: str) -> str | None:
        names = named.get(tuple(ranks))
        if not names:
            return None
        if category == EP_ALL_TO_ALL and "ep" in names:
            return "ep"
        return names[0]  # the mesh's own dimensions were named first, then the flattened ones

    return dim_of


def trace_rank(cfg: Config, world_size: int, rank: int, *, gpu: bool,
               routing: AssumedRouting = AssumedRouting(), micro_batches: int | None = None) -> RankTrace:
    """Trace one iteration of `cfg` as rank `rank` of `world_size` (see the module doc).
    `gpu`: the job runs on GPUs (NCCL collectives; bf16 compute if `train.dtype` says so);
    otherwise on CPUs with gloo, as this machine's runs do. `micro_batches` (>= 2): how many of
    the step's micro-batches run (None: `traced_micro_batches`); the others repeat them."""
    started = time.perf_counter()
    micro_batches = micro_batches or traced_micro_batches(cfg, gpu)
    cfg = _without_compile(cfg)
    device = torch.device("cuda" if gpu else "cpu")  # the precision policy, gloo's reduce-scatter
    with fake_world(world_size, rank), gpu_collectives_and_kernels(gpu), sharding_metadata_apart():
        dims = ParallelDims.from_config(cfg, world_size)
        dims.build_mesh("cpu")
        model = build_model(cfg.model, device="meta")
        if dims.is_distributed:
            split_model(model, dims, cfg.parallel)
        model = apply_training_wrappers(model, cfg)
        if dims.is_distributed:
            apply_fsdp(model, dims, device, cfg.train.dtype, cfg.parallel)
        coords = mesh_coordinates(dims) if dims.is_distributed else {}
        namer = group_dim_namer(dims) if dims.is_distributed else (lambda ranks, category: None)
        with FakeTensorMode(allow_non_fake_inputs=True), assume_routing(routing):
            model.to_empty(device="cpu")
            model.train()
            optimizer = build_optimizer(model, cfg.optim)
            communication = install_gloo_communication(model, optimizer, dims, device, cfg.parallel.reduce_wire_dtype)
            step = TrainingStep(model, optimizer, build_scheduler(optimizer, cfg),
                                StepGuard(cfg.stability), cfg, torch.device("cpu"), dims, communication=communication)
            grad_accum = grad_accum_for(cfg.train, dims.dp)
            parts = [_micro_batch(cfg, dims) for _ in range(min(grad_accum, micro_batches))]
            create_optimizer_state(step)
            log = CollectiveLog(dim_of=namer)
            # The step's own autocast (train.dtype = "bf16") gives the traced tensors bf16 compute.
            with (tracking_memory(model, optimizer, dims.is_distributed) as tracker, log, CpuGroupedMatmul(),
                  marking_forwards(model, log.calls) as forward_starts):
                _, _, counts = step.accumulate_gradients(parts, iteration=1)
                step.update(global_grad_norm(step.params), counts)
                optimizer.zero_grad(set_to_none=True)
            calls = repeat_micro_batches(log.calls, forward_starts, grad_accum)
            memory = peak_by_category(tracker)
            ckpt = sum(local_bytes(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor))
            ckpt += sum(local_bytes(t) for state in optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor) and t.ndim > 0)
            local = sum(_local_numel(p) for p in model.parameters())
    return RankTrace(rank, coords, memory, calls, ckpt, local, time.perf_counter() - started, len(parts))


@contextlib.contextmanager
def marking_forwards(model, calls: list):
    """Yields a list that receives len(`calls`) at every forward of the root `model`: where each
    micro-batch's collectives begin."""
    starts: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: starts.append(len(calls)), prepend=True)
    try:
        yield starts
    finally:
        handle.remove()


def repeat_micro_batches(calls: list, forward_starts: list[int], grad_accum: int) -> list:
    """A step of `grad_accum` micro-batches from a trace of fewer: the calls of the last traced
    micro-batch but one (from its forward to the next one's: the first of two, the middle of
    three) once more for each micro-batch not traced."""
    missing = grad_accum - len(forward_starts)
    if missing <= 0:
        return calls
    start, end = forward_starts[-2], forward_starts[-1]
    return calls[:end] + calls[start:end] * missing + calls[end:]


@contextlib.contextmanager
def _one_forward_at_a_time(model, tracker):
    """FSDPMemTracker keeps per-module statistics of one forward and refuses a second forward of
    the root (the next micro-batch); its peak is kept apart and is global. Clearing the former
    before each forward of the root lets it follow a whole step. A global hook registered before
    the tracker's own runs before them (global hooks run in registration order)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def clear(module, args):
        if module is model:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(clear)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def tracking_memory(model, optimizer, distributed: bool):
    """One iteration's memory followed by category: `FSDPMemTracker` for an FSDP model,
    `MemTracker` for one process. A trace and a real run's measurement use the same one."""
    if distributed:
        tracker = FSDPMemTracker(model, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)

    with _one_forward_at_a_time(model, tracker), tracker:
        yield tracker


def peak_by_category(tracker) -> dict[str, int]:
    """Bytes by the plan's categories at the tracker's peak."""
    memory = dict.fromkeys(CATEGORIES, 0)
    for dev_stats in tracker.get_tracker_snapshot("peak").values():
        for name, value in dev_stats.items():
            if name in CATEGORY_OF:
                memory[CATEGORY_OF[name]] += int(value)
    return memory
