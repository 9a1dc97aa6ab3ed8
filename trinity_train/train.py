"""The Trainer: composes model, data, optimizer, schedule, stability, checkpoints and metrics.

Each iteration draws the next global batch, lets `step.TrainingStep` train on it (or skip it),
records what happened, and validates and checkpoints when due (DESIGN §2). When the guard asks for
a rollback, the Trainer restores a checkpoint from before the incident through the resume path,
rules out the batches since it in the skip ledger and continues (DESIGN §7); every skip and every
rollback leaves an incident report.

Model, optimizer and data come in through small builders (`build_model_for_training`,
`build_optimizer`, `build_loaders`), so parallelism can be applied from outside without touching
the step.

Determinism: everything is seeded from `train.seed`, the data order is a pure function of the
seed and the batch index, and a checkpoint holds every piece of state the next step reads (model
with expert biases, optimizer, scheduler, loader position, guard history, LR back-off, counters,
RNG streams), so a resumed run computes bit-identical losses to an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trinity_train.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, load_checkpoint
from trinity_train.checkpoint.compat import config_differences, describe_differences
from trinity_train.checkpoint.integrity import find_sound_checkpoint
from trinity_train.checkpoint.manager import read_compatible_meta
from trinity_train.config import Config, config_to_dict, load_config, save_config
from trinity_train.data import build_loaders
from trinity_train.data.loader import dataset_dirs
from trinity_train.data.provenance import batch_documents
from trinity_train.data.ledger import LedgerKind, SkipLedger
from trinity_train.errors import ConfigError
from trinity_train.model.counting import training_flops_per_token
from trinity_train.observe import MetricsRecorder, expert_load_stats, measure_peak_flops, mfu, supersede_records_after
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.parallel.process_group import (destroy_distributed, init_distributed, leave_together,
                                                  resolve_device, world_size_from_env)
from trinity_train.records import EventName, IncidentAction, event, fields_of, incident_report, layers_record, \
    train_record, val_record
from trinity_train.rundir import RunDir
from trinity_train.runlock import run_dir_owned
from trinity_train.stability import StepGuard, TrainingDivergedError
from trinity_train.stability.drills import FaultInjector
from trinity_train.stability.incidents import signal_rows, write_incident
from trinity_train.stability.rollback import LRBackoff, plan_rollback
from trinity_train.step import StepResult, TrainingStep, evaluate

# Train records kept for the incident reports (the signals before a skip).
INCIDENT_CONTEXT = 24


# ---------------------------------------------------------------------------- small seams


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator


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
    """Refuse to start a fresh run over a different run, or where its files cannot be written;
    returns how the config changed."""
    RunDir(run_dir).require_writable()
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
        self.rundir = RunDir(self.run_dir)
        # Everything that can be checked without work is checked first.
        self.config_changes = check_run_dir(cfg, self.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint,
                                             protect_lookback=_protected_lookback(cfg))
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
        self.guard = StepGuard(cfg.stability, warmup_steps=cfg.optim.warmup_steps)
        self.lr_backoff = LRBackoff()
        self.faults = FaultInjector(cfg.stability.inject, rank=self.dims.rank, vocab_size=cfg.model.vocab_size)
        self.state = TrainerState()
        # Batches skipped by this run are recorded in the ledger and never drawn again; a fresh
        # run starts with an empty one, a resumed run keeps what its predecessors recorded.
        self.ledger = SkipLedger.load(self.rundir.ledger) if self.resume_from else SkipLedger(self.rundir.ledger)
        self.train_loader, self.val_loader = build_loaders(cfg, dp_rank=self.dims.dp_rank,
                                                           dp_size=self.dims.dp, ledger=self.ledger)
        self.step_fn = TrainingStep(self.model, self.optimizer, self.scheduler, self.guard, cfg, self.device,
                                    self.dims, lr_backoff=self.lr_backoff, faults=self.faults)
        self.recent: deque[dict] = deque(maxlen=INCIDENT_CONTEXT)  # the last train records
        self.skip_streak: list[int] = []  # batch indices of the skips in a row so far
        self.dataset_dirs = dataset_dirs(cfg.data)

    @property
    def rollbacks(self) -> int:
        """Rollbacks of this run so far, resumes included (counted from the ledger)."""
        return len(self.ledger.rollbacks())

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optimizer),
                "scheduler": self.scheduler, "loader": self.train_loader, "guard": self.guard,
                "lr_backoff": self.lr_backoff, "trainer": self.state, "rng": RNGState()}

    def _restore_or_init(self) -> list[dict]:
        """Load the resume checkpoint if there is one, else the init_from weights if asked;
        returns the events to record."""
        self.checkpoints.remove_interrupted_saves()
        if self.resume_from is not None:
            load_checkpoint(self.resume_from, self.checkpoint_state(), self.cfg)
            # The schedule set the configured rates for the resumed step; a back-off scales them.
            self.lr_backoff.apply(self.optimizer, self.scheduler.get_last_lr(), self.state.step)
            # Skips after the checkpoint are judged again, as the uninterrupted run judged them.
            self.ledger.forget_skips_after(self.state.iteration)
            return [event(EventName.RESUME, checkpoint=str(self.resume_from), step=self.state.step,
                          iter=self.state.iteration)]
        if self.cfg.checkpoint.init_from:
            load_checkpoint(Path(self.cfg.checkpoint.init_from), {"model": ModelState(self.model)}, self.cfg)
            return [event(EventName.INIT_FROM, checkpoint=self.cfg.checkpoint.init_from)]
        return []

    def _prepare_run_dir(self) -> list[dict]:
        """Write the config and the ledger; returns the events to record."""
        if not self.is_main:
            return []
        self.rundir.path.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.rundir.config)
        if self.resume_from is not None or self.ledger.path.exists():
            self.ledger.save()  # a fresh run must not inherit an earlier run's skips
        # What an interrupted or earlier run logged past this starting point is superseded.
        moved = supersede_records_after(self.rundir, self.state.iteration)
        return [event(EventName.SUPERSEDED, from_iter=self.state.iteration, records=moved)] if moved else []

    def _save(self, recorder: MetricsRecorder) -> None:
        step, iteration = self.state.step, self.state.iteration

        def committed(path: Path) -> None:  # when the checkpoint is complete (an async one: later)
            recorder.event(event(EventName.CHECKPOINT, step=step, iter=iteration, path=str(path),
                                 async_save=self.cfg.checkpoint.async_save))

        self.checkpoints.save(step, self.checkpoint_state(), self.cfg, on_commit=committed, iteration=iteration)

    def _validate(self, recorder: MetricsRecorder, summary: TrainSummary) -> None:
        val_loss, val_tokens = evaluate(self.model, self.val_loader, self.cfg, self.device, self.dims)
        recorder.validation(val_record(iter=self.state.iteration, step=self.state.step, val_loss=val_loss,
                                       val_ppl=math.exp(min(val_loss, 50.0)), val_tokens=val_tokens))
        if summary.first_val_loss is None:
            summary.first_val_loss = val_loss
        summary.last_val_loss = val_loss

    def _save_ledger(self) -> None:
        if self.is_main:
            self.ledger.save()

    def _record_skip(self, result: StepResult, batch_index: int, recorder: MetricsRecorder) -> None:
        verdict = result.verdict
        self.ledger.add(batch_index, batch_index + 1, reason=f"skipped step: {verdict.reason}", kind=LedgerKind.SKIP,
                        iteration=self.state.iteration)
        self._save_ledger()
        report = self.rundir.incident(self.state.iteration)
        recorder.event(event(EventName.SKIP, iter=self.state.iteration, step=self.state.step, batch=batch_index,
                             reason=verdict.reason, loss=result.loss, grad_norm=result.grad_norm,
                             loss_z=verdict.loss_z, grad_norm_z=verdict.grad_norm_z,
                             incident=str(report.relative_to(self.rundir.path))))
        z = max((v for v in (verdict.loss_z, verdict.grad_norm_z) if v is not None), default=None)
        recorder.notice(f"iteration {self.state.iteration}: step skipped ({verdict.reason}"
                        f"{f', z {z:.1f}' if z is not None else ''}; loss {result.loss:.4f}, grad norm "
                        f"{result.grad_norm:.3g}); report {report}")

    def _report_incident(self, result: StepResult, step: int, action: IncidentAction, batches: list[int],
                         drill: list[dict], rollback: dict | None = None) -> None:
        """Write the incident report of this iteration, which found `step` optimizer steps applied
        (main process only)."""
        if not self.is_main:
            return
        report = incident_report(
            iter=self.state.iteration, step=step, action=action, reason=result.verdict.reason,
            onset_iter=result.verdict.onset_iter, signals=signal_rows(list(self.recent)),
            layer_grad_norms=result.layer_grad_norms,
            batches=[{"index": b, "documents": batch_documents(self.train_loader, self.dataset_dirs, b)}
                     for b in batches],
            drill=drill, lr=result.lrs, rollback=rollback and fields_of(rollback))
        write_incident(self.rundir, report)

    def _rollback_target(self, max_step: int, recorder: MetricsRecorder) -> Path | None:
        """The newest checkpoint at or before `max_step` that passes its integrity check (sizes and
        checksums); damaged ones are reported and passed over, never loaded. Rank 0 decides for
        every rank."""
        return find_sound_checkpoint(self.checkpoints.checkpoints_dir, max_step, on_passed_over=lambda path, why:
                                     recorder.event(event(EventName.CHECKPOINT_PASSED_OVER, path=str(path),
                                                          reason=why)))

    def _roll_back(self, result: StepResult, last_bad_batch: int, recorder: MetricsRecorder) -> dict | None:
        """Restore a checkpoint from before the incident's onset and never train on the batches
        drawn since it (nor on `skip_extra_batches` after the trigger); returns the rollback event,
        or None when there is no checkpoint to go back to.

        Everything stateful comes back (weights, optimizer, schedule, loader position, guard,
        RNG), as on a resume; the iteration counter alone keeps counting, so log lines stay unique.
        The result is the run that would have been trained with those batches in the ledger from
        the start (with the LR back-off, if one is configured, on top).
        """
        cfg, verdict = self.cfg.stability, result.verdict
        iteration, from_step = self.state.iteration, self.state.step
        if self.cfg.checkpoint.every <= 0:
            recorder.event(event(EventName.ROLLBACK_UNAVAILABLE, iter=iteration, step=from_step,
                                 reason="checkpoint.every = 0"))
            return None
        plan = plan_rollback(cfg, self.ledger.rollbacks(), verdict.onset_iter, verdict.onset_step, iteration)
        self.checkpoints.wait()  # an in-flight save may be the target
        target = self._rollback_target(plan.max_target_step, recorder)
        if target is None:
            recorder.event(event(EventName.ROLLBACK_UNAVAILABLE, iter=iteration, step=from_step,
                                 reason=f"no sound checkpoint at or before step {plan.max_target_step}"))
            return None
        windows = self.guard.windows()
        load_checkpoint(target, self.checkpoint_state(), self.cfg)
        self.guard.keep_windows(windows)
        restored_iter, first_bad = self.state.iteration, self.train_loader.position
        skipped = [first_bad, last_bad_batch + 1 + plan.extra_batches]
        self.ledger.add(*skipped, reason=f"rollback to step {self.state.step}", kind=LedgerKind.ROLLBACK,
                        iteration=iteration,
                        target_step=self.state.step, extra_batches=plan.extra_batches, repeat=plan.repeat,
                        onset_iter=verdict.onset_iter)
        self._save_ledger()
        # Checkpoints after the target hold the timeline that was just undone: never resume from them.
        discarded = self.checkpoints.discard_after(self.state.step)
        self.lr_backoff.start(self.state.step, plan.lr_scale, cfg.lr_backoff_steps)
        self.lr_backoff.apply(self.optimizer, self.scheduler.get_last_lr(), self.state.step)
        self.state.iteration = iteration
        rolled_back = event(EventName.ROLLBACK, iter=iteration, from_step=from_step, to_step=self.state.step,
                            to_iter=restored_iter, checkpoint=str(target), skipped_batches=skipped,
                            rollbacks=self.rollbacks, onset_iter=verdict.onset_iter, repeat=plan.repeat,
                            lr_scale=plan.lr_scale, discarded_checkpoints=[str(p) for p in discarded],
                            incident=str(self.rundir.incident(iteration).relative_to(self.rundir.path)))
        recorder.event(rolled_back)
        recorder.notice(f"iteration {iteration}: rolled back from step {from_step} to step {self.state.step} "
                        f"({target.name}); batches {skipped[0]}-{skipped[1] - 1} will not be trained on"
                        + (f"; learning rate x{plan.lr_scale:g}" if plan.lr_scale < 1.0 else ""))
        if plan.lr_scale < 1.0:
            recorder.event(event(EventName.LR_BACKOFF, iter=iteration, scale=plan.lr_scale,
                                 ramp_steps=cfg.lr_backoff_steps))
        return rolled_back

    def _start_events(self, events: list[dict]) -> list[dict]:
        events = [event(EventName.RUN_START, step=self.state.step, iter=self.state.iteration,
                        device=str(self.device), devices=self.dims.world_size,
                        resumed_from=str(self.resume_from) if self.resume_from else None)] + events
        if self.config_changes:
            events.insert(1, event(EventName.CONFIG_CHANGED, changes=[[k, a, b] for k, a, b in self.config_changes]))
        events[1:1] = [event(EventName.CHECKPOINT_PASSED_OVER, path=str(path), reason=reason)
                       for path, reason in self.checkpoints.passed_over]
        if self.cfg.stability.rollback_after > 0 and self.cfg.checkpoint.every <= 0:
            if self.is_main:
                print("warning: stability.rollback_after is set but checkpoint.every = 0: with no checkpoints "
                      "to go back to, spikes are only skipped", file=sys.stderr)
            events.append(event(EventName.ROLLBACK_UNAVAILABLE, iter=self.state.iteration, step=self.state.step,
                                reason="checkpoint.every = 0"))
        return events

    def run(self) -> TrainSummary:
        cfg = self.cfg
        started = time.perf_counter()
        events = self._restore_or_init()
        # Checkpoints of steps after the start are a future this start abandons: never resumed.
        if moved := self.checkpoints.abandon_after(self.state.step, self.resume_from):
            events.append(event(EventName.CHECKPOINTS_ABANDONED, step=self.state.step,
                                checkpoints=[str(a) for a, _ in moved], moved_to=[str(b) for _, b in moved]))
        events += self._prepare_run_dir()
        recorder = MetricsRecorder(cfg, self.run_dir, start_step=self.state.step, is_main=self.is_main)
        recorder.events(self._start_events(events))

        throughput = Throughput(cfg, self.device, self.dims.world_size)
        summary = TrainSummary(self.run_dir, start_step=self.state.step, step=self.state.step,
                               iteration=self.state.iteration)
        try:
            if cfg.train.eval_every > 0 and self.resume_from is None and self.state.step < cfg.train.steps:
                self._validate(recorder, summary)  # the starting point: about ln(vocab)
            while self.state.step < cfg.train.steps:
                self._one_iteration(recorder, throughput, summary)
            self.checkpoints.wait()
        except TrainingDivergedError as e:
            recorder.event(event(EventName.HALT, iter=self.state.iteration, step=self.state.step,
                                 reason=" ".join(str(e).split()), exit_code=e.exit_code))
            raise
        finally:
            summary.wall_s = time.perf_counter() - started
            summary.step, summary.iteration = self.state.step, self.state.iteration
            recorder.event(event(EventName.RUN_END, step=self.state.step, iter=self.state.iteration,
                                 wall_s=summary.wall_s))
            recorder.close()
        return summary

    def _one_iteration(self, recorder: MetricsRecorder, throughput: "Throughput", summary: TrainSummary) -> None:
        self.checkpoints.poll()  # commits an asynchronous save whose write has finished
        started = time.perf_counter()
        batch = self.train_loader.next_batch()
        self.state.iteration += 1
        drill = self.faults.events(self.state.iteration, batch.index)
        recorder.events(drill)
        for fault in drill:
            where = "" if fault["rank"] is None else f" on rank {fault['rank']}"
            recorder.notice(f"iteration {self.state.iteration}: drill: injected {fault['fault']}{where}")
        self.faults.poison(batch)
        result = self.step_fn(batch, self.state.iteration, self.state.step)
        elapsed = time.perf_counter() - started
        recorder.events(result.verdict.events)
        verdict = result.verdict
        if verdict.apply:
            self.state.step += 1
            self.state.tokens_seen += result.tokens
            self.skip_streak.clear()
        else:
            summary.skipped_steps += 1
            self.skip_streak.append(batch.index)
            self._record_skip(result, batch.index, recorder)
        record = step_record(result, self.state, batch.index, throughput.of(result.tokens, elapsed))
        recorder.train(record)
        if result.layer_stats is not None:
            recorder.layers(layers_record(iter=self.state.iteration, step=self.state.step, **result.layer_stats))
        self.recent.append(record)
        summary.last_loss = result.loss
        if verdict.apply:
            self._after_applied_step(recorder, summary)
            return
        rollback, streak, step = None, list(self.skip_streak), self.state.step
        if verdict.rollback:
            try:
                rollback = self._roll_back(result, batch.index, recorder)
            except TrainingDivergedError:
                self._report_incident(result, step, IncidentAction.HALT, streak, drill)
                raise
        if rollback is not None:
            summary.rollbacks += 1
            self.skip_streak.clear()
        self._report_incident(result, step, IncidentAction.ROLLBACK if rollback else IncidentAction.SKIP,
                              streak if rollback else [batch.index], drill, rollback)

    def _after_applied_step(self, recorder: MetricsRecorder, summary: TrainSummary) -> None:
        cfg, step = self.cfg, self.state.step
        if cfg.train.eval_every > 0 and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
            self._validate(recorder, summary)
        if self.checkpoints.is_due(step) or (step == cfg.train.steps and cfg.checkpoint.every > 0):
            self._save(recorder)


def _protected_lookback(cfg: Config) -> int | None:
    """How far back retention must keep a checkpoint for a rollback (None: rollbacks are off)."""
    return cfg.stability.rollback_lookback if cfg.stability.rollback_after > 0 else None


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


def step_record(result: StepResult, state: TrainerState, batch_index: int, throughput: dict[str, float]) -> dict[str, Any]:
    """One line of metrics.jsonl."""
    return train_record(
        iter=state.iteration, step=state.step, batch=batch_index, loss=result.loss, aux_loss=result.aux_loss,
        z_loss=result.z_loss, grad_norm=result.grad_norm, lr=result.lrs.get("adamw", next(iter(result.lrs.values()))),
        lr_muon=result.lrs.get("muon"), tokens=result.tokens, tokens_seen=state.tokens_seen, **throughput,
        skipped=not result.verdict.apply, loss_z=result.verdict.loss_z, grad_norm_z=result.verdict.grad_norm_z,
        skip_reason=None if result.verdict.apply else result.verdict.reason,
        lr_scale=result.lr_scale if result.lr_scale != 1.0 else None, **expert_load_stats(result.tokens_per_expert))


def train(cfg: Config) -> TrainSummary:
    """Run (or resume) the training job `cfg` describes in this process; returns what it did.
    Under torchrun (see launch/) this process is one rank of the job."""
    if world_size_from_env() == 1:
        with run_dir_owned(cfg.run.dir):  # before anything reads or writes the run directory
            return Trainer(cfg).run()
    dims, device = init_distributed(cfg)  # rejects an impossible layout before joining
    try:
        with run_dir_owned(cfg.run.dir):  # rank 0 holds it for the job
            builder = functools.partial(build_model_for_training, dims=dims)
            summary = Trainer(cfg, dims, device, model_builder=builder).run()
            leave_together()
        return summary
    finally:
        destroy_distributed()
