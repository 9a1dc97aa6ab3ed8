"""Real training runs measured as `trinity-train plan` traces them, for the plan's checks
(tests/test_plan_checks.py, benchmarks/plan_vs_measured.py).

One iteration of a real `Trainer` (the default model of configs/debug.toml with overrides, on
this process or on gloo ranks from `ranks.py`), after the first one (`MEASURED_ITERATION`:
the optimizer state exists, as in every step of a long run), is measured three ways:

- its collectives, by the planner's own `CollectiveLog` (bytes sent per category);
- its memory by the planner's own tracker (`plan.trace.tracking_memory`: FSDPMemTracker or
  MemTracker) on the real tensors: the same accounting as the trace, so a difference is a
  difference in which tensors live when;
- its memory as the operating system sees it (for the benchmark): the peak RSS during the step
  (VmHWM, reset just before it through /proc/self/clear_refs) above the RSS before it, plus the
  bytes of the parameters, gradients and optimizer state alive before it. glibc is set to map
  every allocation of 64 KiB or more on its own and to unmap it when freed (`mallopt`), so RSS
  follows the live tensors instead of what the allocator keeps cached. RSS also sees what the
  tracker cannot: buffers an ATen kernel allocates inside one op (the loss's `logsumexp` makes
  a logits-sized one: 32 MiB at 1,024 tokens x 8,192), the libraries' own buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from pathlib import Path

import torch

from trinity_train.callbacks import TrainerCallback
from trinity_train.config import Config, default_config_path, load_config
from trinity_train.plan.collectives import CollectiveLog, sent_by_category
from trinity_train.plan.trace import RankTrace, local_bytes, peak_by_category, trace_rank, tracking_memory

MEASURED_ITERATION = 2
# What every measured run sets beside its layout: no validation, checkpoints, layer statistics or
# compile; one iteration to warm up and the measured one.
QUIET = ("--eval.every=0", "--checkpoint.every=0", "--metrics.progress_bar=false",
         "--metrics.layer_stats_every=0", "--train.compile=false", f"--train.steps={MEASURED_ITERATION}")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_FROM_BYTES = 64 * 1024
# The batch of the memory checks: 4 sequences of 256 tokens a step, 2 per micro-batch.
MEMORY_BATCH = ("--train.global_batch_size=4", "--train.micro_batch_size=2")
# The layouts whose memory is checked: (ranks, overrides). TP x EP takes 4 ranks: ep divides
# dp_shard (ParallelDims), so tp=2 x ep=2 needs dp_shard=2.
LAYOUTS = {
    "one process": (1, ()),
    "FSDP 2": (2, ("--parallel.dp_shard=2",)),
    "FSDP 2 x EP 2": (2, ("--parallel.ep=2",)),
    "TP 2 x FSDP 2 x EP 2": (4, ("--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2")),
}


def measured_config(overrides: tuple[str, ...] | list[str], run_dir: Path) -> Config:
    """configs/debug.toml with `overrides`, quiet, running `MEASURED_ITERATION` steps into `run_dir`."""
    return load_config(default_config_path(), [*overrides, *QUIET, f"--run.dir={run_dir}"])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def resident_state_bytes(model, optimizer) -> int:
    """Parameters, gradients and optimizer state this rank holds (local shards)."""
    total = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    total += sum(local_bytes(b) for b in model.buffers())
    return total + sum(local_bytes(t) for state in optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor))


class MeasureIteration(TrainerCallback):
    """Measures iteration `MEASURED_ITERATION` of the trainer it is attached to (see the module doc)."""

    def __init__(self, memory: bool, rss: bool):
        self.memory, self.rss = memory, rss
        self.log = CollectiveLog()
        self.result: dict = {}
        self._tracking = contextlib.ExitStack()
        if rss:  # for the rest of the process: a benchmark's, not the tests'
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM_BYTES)
            libc.mallopt(M_TRIM_THRESHOLD, MMAP_FROM_BYTES)
            self._trim = libc.malloc_trim

    def before_step(self, trainer, batch):
        if trainer.state.iteration != MEASURED_ITERATION:
            return
        if self.rss:
            gc.collect()
            self._trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.result["resident_before"] = resident_state_bytes(trainer.model, trainer.optimizer)
            self.result["rss_before"] = _status_kib("VmRSS") * 1024
        if self.memory:
            self._tracker = self._tracking.enter_context(
                tracking_memory(trainer.model, trainer.optimizer, trainer.dims.is_distributed))
        self._tracking.enter_context(self.log)

    def after_step(self, trainer, result, record):
        if trainer.state.iteration != MEASURED_ITERATION:
            return
        self._tracking.close()
        self.result["traffic"] = sent_by_category(self.log.calls)
        if self.rss:
            self.result["rss_peak"] = _status_kib("VmHWM") * 1024
        if self.memory:
            self.result["tracked"] = peak_by_category(self._tracker)
            self.result["tracked_peak"] = sum(self.result["tracked"].values())


def measure_rank(overrides: tuple[str, ...], run_dir: Path, memory: bool, rss: bool = False) -> dict:
    """In one rank of a `ranks.py` job (or in this process, which then trains alone): train
    `measured_config(overrides)` and return what `MeasureIteration` measured: "traffic" always,
    "tracked" and "tracked_peak" with `memory`, and with `rss` the OS's view: "rss_growth" and
    "rss_peak_estimate" (the parameters, gradients and optimizer state before the step + the
    growth)."""
    from trinity_harness.ranks import rank_trainer
    from trinity_train.train import Trainer

    measure = MeasureIteration(memory, rss)  # before the model is built: glibc's settings apply to it
    cfg = measured_config(overrides, run_dir)
    trainer = rank_trainer(cfg) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Trainer(cfg)
    trainer.add_callback(measure)
    trainer.run()
    result = measure.result
    if rss:
        result["rss_growth"] = result["rss_peak"] - result["rss_before"]
        result["rss_peak_estimate"] = result["resident_before"] + result["rss_growth"]
    return result


def trace_measured(overrides: tuple[str, ...], run_dir: Path, world: int, rank: int) -> RankTrace:
    """The plan's trace of `rank` for the config `measure_rank` trains (in a process with no
    process group: the trace is one of a fake world)."""
    return trace_rank(measured_config(overrides, run_dir), world, rank, gpu=False)
