"""The Trainer: composes model, data, optimizer, schedule, stability, checkpoints and metrics.

One optimizer step (`TrainingStep`), as data flows (DESIGN §2):
  forward + backward over the micro-batches, each scaled so the summed gradient is that of the
  token-weighted mean cross entropy of the whole global batch (plus aux and z losses) ->
  global loss and pre-clip gradient norm -> `StepGuard` verdict (apply or skip) ->
  clip, optimizer step, expert-bias update from the step's tokens per expert, scheduler step.

Every place where a distributed run must combine values across data-parallel ranks goes through
`parallel.reductions` with the run's `ParallelDims` (marked "DP all-reduce"); in one process the
dims have no mesh and the sums are the identity, so one code path serves one and N ranks. Each
rank's loss is its share of the global token-weighted mean, so the data-parallel gradient
reduction must SUM rank gradients, not average them (FSDP2: `set_gradient_divide_factor(1.0)`).
Model, optimizer and data come in through small builders (`build_model_for_training`,
`build_optimizer`, `build_loaders`), so parallelism can be applied from outside without touching
the step.

Determinism: everything is seeded from `train.seed`, the data order is a pure function of the
seed and the batch index, and a checkpoint holds every piece of state the next step reads (model
with expert biases, optimizer, scheduler, loader position, guard history, counters, RNG streams),
so a resumed run computes bit-identical losses to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trinity_train.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, load_checkpoint
from trinity_train.checkpoint.compat import config_differences, describe_differences
from trinity_train.checkpoint.layout import newest_checkpoint
from trinity_train.checkpoint.manager import read_compatible_meta
from trinity_train.config import Config, config_to_dict, load_config, save_config
from trinity_train.data import build_loaders
from trinity_train.data.ledger import SkipLedger
from trinity_train.errors import ConfigError
from trinity_train.model.counting import training_flops_per_token
from trinity_train.model.loss import IGNORE_INDEX
from trinity_train.observe import MetricsRecorder, expert_load_stats, measure_peak_flops, mfu, supersede_records_after
from trinity_train.observe.layer_stats import LayerStatsCollector
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.parallel.process_group import (destroy_distributed, init_distributed, leave_together,
                                                  resolve_device, world_size_from_env)
from trinity_train.parallel.reductions import clip_grads_with_norm_, global_grad_norm, sum_over_data_parallel
from trinity_train.rundir import RunDir
from trinity_train.stability import StepGuard, TrainingDivergedError, Verdict

# How the ledger names the ranges a rollback skipped (and how their number is recovered on resume).
ROLLBACK_REASON = "rollback"


# ---------------------------------------------------------------------------- small seams


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator


def autocast_context(cfg: Config, device: torch.device):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_training_wrappers(model: nn.Module, cfg: Config) -> nn.Module:
    """Activation checkpointing, then compilation, per block (DESIGN §4 order), in place: the
    parameter names seen by checkpoints are unchanged."""
    if cfg.train.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    return model


def build_model_for_training(cfg: Config, device: torch.device, dims: ParallelDims | None = None) -> nn.Module:
    """The model with freshly drawn weights (seeded by `train.seed`), on `device`, wrapped, and
    split over the ranks of `dims` when given; one process draws the same weights."""
    seed_everything(cfg.train.seed)
    model = build_parallel_model(cfg, dims or ParallelDims.one_process(), device, wrap=apply_training_wrappers)
    model.train()
    return model


# ---------------------------------------------------------------------------- one step


@dataclass
class StepResult:
    loss: float  # mean cross entropy over the step's counted tokens, all ranks
    aux_loss: float
    z_loss: float
    grad_norm: float  # global, before clipping
    tokens: int  # counted (label) tokens, all ranks
    tokens_per_expert: torch.Tensor  # [num_moe_layers, E], summed over micro-batches and ranks
    lrs: dict[str, float]  # learning rate of each group kind for this step
    verdict: Verdict
    layer_stats: dict | None = None  # the "layers" record (without iter/step) on statistics iterations


def micro_batches(batch: Any, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Split the rank's rows of a global batch into micro-batches of model inputs."""
    fields = ("input_ids", "labels", "position_ids", "document_ids")
    tensors = {f: getattr(batch, f) for f in fields if getattr(batch, f, None) is not None}
    rows = tensors["input_ids"].shape[0]
    return [{f: t[start:start + micro_batch_size] for f, t in tensors.items()}
            for start in range(0, rows, micro_batch_size)]


def _forward(model: nn.Module, mb: dict[str, torch.Tensor], cfg: Config, device: torch.device):
    mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
    with autocast_context(cfg, device):
        return model(mb["input_ids"], labels=mb["labels"], position_ids=mb.get("position_ids"),
                     document_ids=mb.get("document_ids"))


class TrainingStep:
    """Forward/backward over micro-batches, the stability verdict, and the optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, guard: StepGuard,
                 cfg: Config, device: torch.device, dims: ParallelDims | None = None):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.guard = guard
        self.cfg = cfg
        self.device = device
        self.dims = dims or ParallelDims.one_process()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layer_stats = LayerStatsCollector(model, cfg.metrics.layer_stats_every, self.dims)

    def learning_rates(self) -> dict[str, float]:
        lrs: dict[str, float] = {}
        for group in self.optimizer.param_groups:
            lrs.setdefault(group.get("kind", "adamw"), float(group["lr"]))
        return lrs

    def __call__(self, batch: Any, iteration: int) -> StepResult:
        parts = micro_batches(batch, self.cfg.train.micro_batch_size)
        # The token-weighted mean needs the global token count before the first backward.
        tokens = sum_over_data_parallel((batch.labels != IGNORE_INDEX).sum().to(self.device),
                                        self.dims)  # DP all-reduce
        # Aux and z losses are means per micro-batch: average them over micro-batches and ranks.
        per_part = 1.0 / (len(parts) * self.dims.dp)

        totals = torch.zeros(3, device=self.device)  # cross-entropy sum, aux loss, z loss
        counts = None
        stats_due = self.layer_stats.due(iteration)
        for mb in parts:
            with self.layer_stats.recording(stats_due):  # the forward only: not recomputations in backward
                out = _forward(self.model, mb, self.cfg, self.device)
            loss = out.ce_sum / tokens.clamp_min(1) + (out.aux_loss + out.z_loss) * per_part
            loss.backward()
            totals += torch.stack([out.ce_sum.detach().float(), out.aux_loss.detach().float() * per_part,
                                   out.z_loss.detach().float() * per_part])
            counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
        totals = sum_over_data_parallel(totals, self.dims)  # DP all-reduce
        counts = sum_over_data_parallel(counts, self.dims)  # DP all-reduce
        ce_sum, aux_loss, z_loss = totals.tolist()
        num_tokens = int(tokens.item())
        mean_loss = ce_sum / max(num_tokens, 1)
        grad_norm = global_grad_norm(self.params)  # global over ranks and shards
        grad_norm_value = grad_norm.item()
        layer_stats = self.layer_stats.collect(counts) if stats_due else None  # pre-clip gradients

        lrs = self.learning_rates()
        verdict = self.guard.judge(mean_loss, grad_norm_value, iteration)
        if verdict.apply:
            if self.cfg.train.grad_clip > 0:
                clip_grads_with_norm_(self.params, self.cfg.train.grad_clip, grad_norm)
            self.optimizer.step()
            self.model.update_expert_biases(counts)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(mean_loss, aux_loss, z_loss, grad_norm_value, num_tokens, counts, lrs, verdict,
                          layer_stats)


@torch.no_grad()
def evaluate(model: nn.Module, val_loader: Any, cfg: Config, device: torch.device,
             dims: ParallelDims | None = None) -> tuple[float, int]:
    """Mean cross entropy over the first `train.eval_batches` validation batches (all ranks)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # cross-entropy sum, tokens
    for batch in val_loader.batches(cfg.train.eval_batches):
        for mb in micro_batches(batch, cfg.train.micro_batch_size):
            out = _forward(model, mb, cfg, device)
            totals += torch.stack([out.ce_sum.double(), out.num_tokens.double()])
    model.train()
    ce_sum, tokens = sum_over_data_parallel(totals, dims or ParallelDims.one_process()).tolist()  # DP all-reduce
    return ce_sum / max(tokens, 1.0), int(tokens)


# ---------------------------------------------------------------------------- the run


class TrainerState:
    """The loop's own counters, checkpointed with everything else."""

    def __init__(self):
        self.iteration = 0  # global batches drawn (applied and skipped steps)
        self.step = 0  # optimizer steps applied
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.iteration, self.step, self.tokens_seen = state["iteration"], state["step"], state["tokens_seen"]


@dataclass
class TrainSummary:
    run_dir: Path
    start_step: int
    step: int
    iteration: int
    first_val_loss: float | None = None
    last_val_loss: float | None = None
    last_loss: float | None = None
    skipped_steps: int = 0
    rollbacks: int = 0  # in this process
    wall_s: float = 0.0

    def describe(self) -> str:
        if self.start_step >= self.step:
            return f"nothing to do: {self.run_dir} is already at step {self.step}"
        val = ""
        if self.last_val_loss is not None:
            first = f"{self.first_val_loss:.4f} -> " if self.first_val_loss not in (None, self.last_val_loss) else ""
            val = f", validation loss {first}{self.last_val_loss:.4f}"
        rolled = f", {self.rollbacks} rolled back" if self.rollbacks else ""
        return (f"trained steps {self.start_step + 1}-{self.step} in {self.wall_s:.1f}s "
                f"(final loss {self.last_loss:.4f}{val}, {self.skipped_steps} skipped{rolled}); "
                f"run directory {self.run_dir}")


# Keys that steer how a run is started or displayed, not what it computes.
RUN_CONTROL_KEYS = frozenset({"checkpoint.resume", "metrics.progress_bar", "train.log_every"})


def check_run_dir(cfg: Config, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """Refuse to start a fresh run over a different run; returns how the config changed."""
    previous_file = RunDir(run_dir).config
    if not previous_file.is_file():
        return []
    fresh = cfg.checkpoint.resume == "none"
    try:
        previous = config_to_dict(load_config(previous_file))
    except ConfigError as e:
        if fresh:
            raise ConfigError(f"run.dir: '{run_dir}' holds a run whose config.toml this version cannot read "
                              f"({e}); choose another --run.dir or delete the directory") from None
        return []
    diffs = [d for d in config_differences(previous, config_to_dict(cfg)) if d[0] not in RUN_CONTROL_KEYS]
    if diffs and fresh:
        raise ConfigError(
            f"run.dir: '{run_dir}' already holds a run with a different config "
            f"({describe_differences(diffs)}); continue it with --checkpoint.resume=auto, "
            "choose another --run.dir, or delete the directory")
    return diffs


ModelBuilder = Callable[[Config, torch.device], nn.Module]


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims | None = None, device: torch.device | None = None,
                 model_builder: ModelBuilder = build_model_for_training):
        """One process by default; a rank of a distributed launch passes its `dims` (with the
        mesh built) and its device."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        # Everything that can be checked without work is checked first.
        self.config_changes = check_run_dir(cfg, self.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint)
        self.resume_from = self.checkpoints.resume_path()
        if self.resume_from is not None:
            read_compatible_meta(self.resume_from, cfg)
        elif cfg.checkpoint.init_from:
            read_compatible_meta(Path(cfg.checkpoint.init_from), cfg)
        if dims is None and dist.is_initialized():
            raise RuntimeError("a distributed run must pass its ParallelDims to Trainer")
        self.dims = dims or ParallelDims.one_process()
        self.device = device or resolve_device(cfg)
        self.is_main = self.dims.is_main  # writes files (metrics, config, ledger); checkpoints coordinate themselves

        self.model = model_builder(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.guard = StepGuard(cfg.stability)
        self.state = TrainerState()
        # Batches skipped by this run are recorded in the ledger and never drawn again; a fresh
        # run starts with an empty one, a resumed run keeps what its predecessors recorded.
        ledger_path = RunDir(self.run_dir).ledger
        self.ledger = SkipLedger.load(ledger_path) if self.resume_from else SkipLedger(ledger_path)
        self.train_loader, self.val_loader = build_loaders(cfg, dp_rank=self.dims.dp_rank,
                                                           dp_size=self.dims.dp, ledger=self.ledger)
        # Counted from the ledger, so resuming a run does not reset its allowance.
        self.rollbacks = sum(r.reason.startswith(ROLLBACK_REASON) for r in self.ledger.ranges)
        self.step_fn = TrainingStep(self.model, self.optimizer, self.scheduler, self.guard, cfg, self.device,
                                    self.dims)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optimizer),
                "scheduler": self.scheduler, "loader": self.train_loader, "guard": self.guard,
                "trainer": self.state, "rng": RNGState()}

    def _restore_or_init(self) -> list[dict]:
        """Load the resume checkpoint if there is one, else the init_from weights if asked;
        returns the events to record."""
        self.checkpoints.remove_interrupted_saves()
        if self.resume_from is not None:
            load_checkpoint(self.resume_from, self.checkpoint_state(), self.cfg)
            return [{"event": "resume", "checkpoint": str(self.resume_from), "step": self.state.step,
                     "iter": self.state.iteration}]
        if self.cfg.checkpoint.init_from:
            load_checkpoint(Path(self.cfg.checkpoint.init_from), {"model": ModelState(self.model)}, self.cfg)
            return [{"event": "init_from", "checkpoint": self.cfg.checkpoint.init_from}]
        return []

    def _prepare_run_dir(self) -> list[dict]:
        """Write the config and a fresh run's ledger; returns the events to record."""
        if not self.is_main:
            return []
        run = RunDir(self.run_dir)
        run.path.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, run.config)
        if self.resume_from is None and self.ledger.path.exists():
            self.ledger.save()  # a fresh run must not inherit an earlier run's skips
        # What an interrupted or earlier run logged past this starting point is superseded.
        moved = supersede_records_after(run, self.state.iteration)
        return [{"event": "superseded", "from_iter": self.state.iteration, "records": moved}] if moved else []

    def _save(self, recorder: MetricsRecorder) -> None:
        path = self.checkpoints.save(self.state.step, self.checkpoint_state(), self.cfg,
                                     iteration=self.state.iteration)
        recorder.event("checkpoint", step=self.state.step, iter=self.state.iteration, path=str(path),
                       async_save=self.cfg.checkpoint.async_save)

    def _validate(self, recorder: MetricsRecorder, summary: TrainSummary) -> None:
        val_loss, val_tokens = evaluate(self.model, self.val_loader, self.cfg, self.device, self.dims)
        recorder.validation({"iter": self.state.iteration, "step": self.state.step, "val_loss": val_loss,
                             "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": val_tokens})
        if summary.first_val_loss is None:
            summary.first_val_loss = val_loss
        summary.last_val_loss = val_loss

    def _record_skip(self, result: StepResult, batch_index: int, recorder: MetricsRecorder) -> None:
        self.ledger.add(batch_index, batch_index + 1, reason=f"skipped step: {result.verdict.reason}")
        if self.is_main:
            self.ledger.save()
        recorder.event("skip", iter=self.state.iteration, step=self.state.step, batch=batch_index,
                       reason=result.verdict.reason, loss=result.loss, grad_norm=result.grad_norm)

    def _roll_back(self, last_bad_batch: int, recorder: MetricsRecorder) -> bool:
        """Restore the newest checkpoint and never train on the batches drawn since it; False
        when there is no checkpoint yet.

        Everything stateful comes back (weights, optimizer, schedule, loader position, guard,
        RNG), as on a resume; the iteration counter alone keeps counting, so log lines stay unique.
        The result is the run that would have been trained with those batches in the ledger from
        the start.
        """
        self.checkpoints.wait()  # an in-flight save may be the newest checkpoint
        target = newest_checkpoint(self.checkpoints.checkpoints_dir)
        if target is None:
            recorder.event("rollback_unavailable", iter=self.state.iteration, step=self.state.step,
                           reason="no checkpoint yet")
            return False
        if self.rollbacks >= self.cfg.stability.max_rollbacks:
            raise TrainingDivergedError(
                f"training diverged: another streak of skipped steps at iteration {self.state.iteration} "
                f"after {self.rollbacks} rollbacks (stability.max_rollbacks); lower optim.lr or "
                "train.grad_clip, or resume from an earlier checkpoint with --checkpoint.resume=PATH")
        iteration, from_step = self.state.iteration, self.state.step
        load_checkpoint(target, self.checkpoint_state(), self.cfg)
        first_bad = self.train_loader.position  # the first batch drawn after the checkpoint
        self.ledger.add(first_bad, last_bad_batch + 1, reason=f"{ROLLBACK_REASON} to step {self.state.step}")
        if self.is_main:
            self.ledger.save()
        self.state.iteration = iteration
        self.rollbacks += 1
        recorder.event("rollback", iter=iteration, from_step=from_step, to_step=self.state.step,
                       checkpoint=str(target), skipped_batches=[first_bad, last_bad_batch + 1],
                       rollbacks=self.rollbacks)
        return True

    def run(self) -> TrainSummary:
        cfg = self.cfg
        started = time.perf_counter()
        events = self._restore_or_init()
        events += self._prepare_run_dir()
        recorder = MetricsRecorder(cfg, self.run_dir, start_step=self.state.step, is_main=self.is_main)
        recorder.event("run_start", step=self.state.step, iter=self.state.iteration, device=str(self.device),
                       devices=self.dims.world_size,
                       resumed_from=str(self.resume_from) if self.resume_from else None)
        if self.config_changes:
            recorder.event("config_changed", changes=[[k, a, b] for k, a, b in self.config_changes])
        for event in events:
            recorder.event(event.pop("event"), **event)

        throughput = Throughput(cfg, self.device, self.dims.world_size)
        summary = TrainSummary(self.run_dir, start_step=self.state.step, step=self.state.step,
                               iteration=self.state.iteration)
        try:
            if cfg.train.eval_every > 0 and self.resume_from is None and self.state.step < cfg.train.steps:
                self._validate(recorder, summary)  # the starting point: about ln(vocab)
            while self.state.step < cfg.train.steps:
                self._one_iteration(recorder, throughput, summary)
            self.checkpoints.wait()
        finally:
            summary.wall_s = time.perf_counter() - started
            summary.step, summary.iteration = self.state.step, self.state.iteration
            recorder.event("run_end", step=self.state.step, iter=self.state.iteration, wall_s=summary.wall_s)
            recorder.close()
        return summary

    def _one_iteration(self, recorder: MetricsRecorder, throughput: "Throughput", summary: TrainSummary) -> None:
        cfg = self.cfg
        started = time.perf_counter()
        batch = self.train_loader.next_batch()
        self.state.iteration += 1
        result = self.step_fn(batch, self.state.iteration)
        elapsed = time.perf_counter() - started
        if result.verdict.apply:
            self.state.step += 1
            self.state.tokens_seen += result.tokens
        else:
            summary.skipped_steps += 1
            self._record_skip(result, batch.index, recorder)
        recorder.train(step_record(result, self.state, throughput.of(result.tokens, elapsed)))
        if result.layer_stats is not None:
            recorder.layers({"iter": self.state.iteration, "step": self.state.step, **result.layer_stats})
        summary.last_loss = result.loss
        if result.verdict.rollback and self._roll_back(batch.index, recorder):
            summary.rollbacks += 1
        if not result.verdict.apply:
            return

        step = self.state.step
        if cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
            self._validate(recorder, summary)
        if self.checkpoints.is_due(step) or (step == cfg.train.steps and cfg.checkpoint.every > 0):
            self._save(recorder)


class Throughput:
    """Tokens per second and MFU of one step."""

    def __init__(self, cfg: Config, device: torch.device, num_devices: int):
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = cfg.metrics.peak_flops or measure_peak_flops(
            device, torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
        self.num_devices = num_devices

    def of(self, tokens: int, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / max(seconds, 1e-9)
        return {"tokens_per_s": tokens_per_s, "step_time_s": seconds,
                "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak, self.num_devices)}


def step_record(result: StepResult, state: TrainerState, throughput: dict[str, float]) -> dict[str, Any]:
    """One line of metrics.jsonl."""
    record = {"iter": state.iteration, "step": state.step, "loss": result.loss, "aux_loss": result.aux_loss,
              "z_loss": result.z_loss, "grad_norm": result.grad_norm,
              "lr": result.lrs.get("adamw", next(iter(result.lrs.values())))}
    if "muon" in result.lrs:
        record["lr_muon"] = result.lrs["muon"]
    record.update(tokens=result.tokens, tokens_seen=state.tokens_seen, **throughput,
                  skipped=not result.verdict.apply)
    if not result.verdict.apply:
        record["skip_reason"] = result.verdict.reason
    record.update(expert_load_stats(result.tokens_per_expert))
    return record


def train(cfg: Config) -> TrainSummary:
    """Run (or resume) the training job `cfg` describes in this process; returns what it did.
    Under torchrun (see launch/) this process is one rank of the job."""
    if world_size_from_env() == 1:
        return Trainer(cfg).run()
    dims, device = init_distributed(cfg)  # rejects an impossible layout before joining
    try:
        builder = functools.partial(build_model_for_training, dims=dims)
        summary = Trainer(cfg, dims, device, model_builder=builder).run()
        leave_together()
        return summary
    finally:
        destroy_distributed()
