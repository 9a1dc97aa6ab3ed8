"""The Trainer: composes model, data, optimizer, schedule, stability, checkpoints and metrics.

Each iteration draws the next global batch, lets `step.TrainingStep` train on it (or skip it),
tells the callbacks (`callbacks.TrainerCallback`: the records, the drills, whatever a caller
attached) what happened, and validates and checkpoints when due (DESIGN §2). A skipped step goes
to `stability.recovery.Recovery`, which keeps the ledger, rolls back through the trainer's resume
path when the guard asks for it, and writes the incident reports (DESIGN §7).

Model, optimizer and data come in through small builders (`build_model_for_training`,
`build_optimizer`, `build_loaders`), so parallelism can be applied from outside without touching
the step.

Determinism: everything is seeded from `train.seed`, the data order is a pure function of the
seed and the batch index, and a checkpoint holds every piece of state the next step reads (model
with expert biases, optimizer, scheduler, loader position, guard history, LR back-off, counters,
RNG streams), so a resumed run computes bit-identical losses to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trinity_train import signals
from trinity_train.callbacks import CallbackList, TrainerCallback
from trinity_train.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, load_checkpoint
from trinity_train.checkpoint.compat import (check_same_seq_len, config_differences, config_from_meta,
                                             describe_differences)
from trinity_train.checkpoint.init_from import check_init_from, init_checkpoint, start_events
from trinity_train.checkpoint.manager import read_compatible_meta
from trinity_train.config import Config, config_to_dict, load_stored_config, save_config
from trinity_train.data import build_loaders
from trinity_train.data.ledger import SkipLedger
from trinity_train.errors import CheckpointError, ConfigError
from trinity_train.evaluation.passkey import probe_for_run
from trinity_train.health.watchdog import WatchdogCallback
from trinity_train.health.rank_stats import RankStatsCallback
from trinity_train.model.counting import training_flops_per_token
from trinity_train.observe import MetricsRecorder, expert_load_stats, measure_peak_flops, mfu, supersede_records_after
from trinity_train.observe.recorder import RecordingCallback
from trinity_train.observe.timeline import TimelineWriter
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler, describe_replanned, replanned
from trinity_train.parallel.gloo.communication import GlooOverlap, install_gloo_communication
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.parallelize import build_parallel_model
from trinity_train.parallel.process_group import (destroy_distributed, init_distributed, leave_together,
                                                  resolve_device, world_size_from_env)
from trinity_train.records import (ENDED, FAILED, HALTED, RUNNING, EventName, Phase, event, passkey_record, train_record,
                                   val_record)
from trinity_train.rundir import RunDir
from trinity_train.run_config import validate_rules
from trinity_train.runlock import run_dir_owned
from trinity_train.stability import StepGuard, TrainingDivergedError
from trinity_train.stability.drills import DrillCallback, FaultInjector
from trinity_train.stability.recovery import Recovery
from trinity_train.stability.rollback import LRBackoff, protected_lookback
from trinity_train.step import StepResult, TrainingStep, evaluate

# ---------------------------------------------------------------------------- small seams


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator


def build_model_for_training(cfg: Config, device: torch.device, dims: ParallelDims | None = None) -> nn.Module:
    """The model with freshly drawn weights (seeded by `train.seed`), on `device`, wrapped, and
    split over the ranks of `dims` when given; one process draws the same weights."""
    seed_everything(cfg.train.seed)
    model = build_parallel_model(cfg, dims or ParallelDims.one_process(), device)
    model.train()
    return model


# ---------------------------------------------------------------------------- the run


@dataclass
class LatestIteration:
    """What became of the loop's latest iteration, for the timeline also when it raised."""

    batch_index: int = -1  # the global batch it drew (an iteration that raised before drawing: the one before's)
    skipped: bool = False  # its step was refused
    stepped: bool = False  # its step is complete (trained or refused, recorded)

    def begin(self) -> None:
        self.skipped = self.stepped = False


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
    status: str = RUNNING  # records.ENDED, HALTED or FAILED once `finish` has run

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
        previous = config_to_dict(load_stored_config(previous_file))
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
    """One run: `run()` restores (or starts fresh), then trains one iteration at a time until
    `train.steps` optimizer steps are applied, validating and checkpointing when due.

    The loop itself only draws batches, runs the step, advances the counters and tells the
    callbacks (`callbacks.TrainerCallback`): writing the records (`observe.RecordingCallback`)
    and the fault drills (`stability.drills.DrillCallback`) attach there first, then whatever
    the caller attached. What to do about a refused step (skip, rollback, halt, incident reports)
    is `stability.recovery.Recovery`'s; the trainer hands it the parts it acts on.
    """

    def __init__(self, cfg: Config, dims: ParallelDims | None = None, device: torch.device | None = None,
                 model_builder: ModelBuilder = build_model_for_training,
                 callbacks: list[TrainerCallback] | None = None, gloo_overlap: GlooOverlap | None = None):
        """One process by default; a rank of a distributed launch passes its `dims` (with the
        mesh built) and its device. `callbacks` run after the built-in ones, in order.
        `gloo_overlap`: a CPU job's overlaps (None: all on; a benchmark's ablation turns one off)."""
        # Everything that can be checked without work is checked first.
        validate_rules(cfg)
        if dims is None and dist.is_initialized():
            raise RuntimeError("a distributed run must pass its ParallelDims to Trainer")
        # One process: a layout that needs more (dp_shard=2, tp=2, ...) is refused, as under torchrun.
        self.dims = dims or ParallelDims.from_config(cfg, 1)
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.rundir = RunDir(self.run_dir)
        self.config_changes = check_run_dir(cfg, self.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint,
                                             protect_lookback=protected_lookback(cfg.stability),
                                             collective_timeout_s=cfg.parallel.collective_timeout_s)
        self.resume_from = self.checkpoints.resume_path()
        # A fresh start from another run's checkpoint (a later phase), checked before any work.
        self.init_from: Path | None = None
        self._init_source: Config | None = None
        if self.resume_from is not None:
            meta = read_compatible_meta(self.resume_from, cfg)
            check_same_seq_len(config_from_meta(meta, self.resume_from), cfg, self.resume_from)
        elif cfg.checkpoint.init_from:
            self.init_from = init_checkpoint(cfg.checkpoint.init_from)
            self._init_source = check_init_from(self.init_from, cfg)
        self.device = device or resolve_device(cfg)
        self.is_main = self.dims.is_main  # writes files (metrics, config, ledger); checkpoints coordinate themselves

        self.model = model_builder(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.communication = install_gloo_communication(self.model, self.optimizer, self.dims, self.device,
                                                        cfg.parallel.reduce_wire_dtype, gloo_overlap)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.guard = StepGuard.for_config(cfg)
        self.lr_backoff = LRBackoff()
        self.faults = FaultInjector(cfg.stability.inject, rank=self.dims.rank, vocab_size=cfg.model.vocab_size)
        # Every save writes through the drills' writer, which fails those a `fail_save` covers.
        self.checkpoints.storage_writer = lambda path: self.faults.storage_writer(path, self.state.iteration)
        self.state = TrainerState()
        # Batches skipped by this run are recorded in the ledger and never drawn again; a fresh
        # run starts with an empty one, a resumed run keeps what its predecessors recorded.
        self.ledger = SkipLedger.load(self.rundir.ledger) if self.resume_from else SkipLedger(self.rundir.ledger)
        self.train_loader, self.val_loader = build_loaders(cfg, dp_rank=self.dims.dp_rank,
                                                           dp_size=self.dims.dp, ledger=self.ledger)
        self.passkey = probe_for_run(cfg, self.train_loader.dataset_dirs[0]) if cfg.eval.passkey_every else None
        self.step_fn = TrainingStep(self.model, self.optimizer, self.scheduler, self.guard, cfg, self.device,
                                    self.dims, lr_backoff=self.lr_backoff, faults=self.faults,
                                    communication=self.communication)
        self.recovery = Recovery(cfg, self.rundir, self.ledger, run=self, loader=self.train_loader,
                                 checkpoints=self.checkpoints, faults=self.faults, is_main=self.is_main)
        self.timeline = TimelineWriter(self.rundir.timeline, enabled=self.is_main)
        # The hang watchdog watches from `start()` to the end of `finish()` (DESIGN §12).
        self.watchdog = WatchdogCallback(cfg.watchdog, self.rundir, self.dims.rank, self.dims.world_size)
        self.callbacks = CallbackList([self.timeline, self.watchdog, RecordingCallback(), DrillCallback(self.faults),
                                       RankStatsCallback.for_config(cfg), *(callbacks or [])])
        # The run's sinks and tallies, from `start()` on.
        self.recorder: MetricsRecorder | None = None
        self.throughput: Throughput | None = None
        self.summary: TrainSummary | None = None
        self._started = 0.0
        self.latest = LatestIteration()
        self._failed_saves = 0  # in a row

    def add_callback(self, callback: TrainerCallback) -> None:
        """Attach `callback` after those already attached."""
        self.callbacks.add(callback)

    @property
    def rollbacks(self) -> int:
        """Rollbacks of this run so far, resumes included."""
        return self.recovery.rollbacks

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optimizer),
                "scheduler": self.scheduler, "loader": self.train_loader, "guard": self.guard,
                "lr_backoff": self.lr_backoff, "trainer": self.state, "rng": RNGState()}

    @contextlib.contextmanager
    def phase(self, phase: Phase):
        """Tell the callbacks the rank is in `phase` for the duration of the block (the timeline,
        the watchdog and the rank statistics time the loop by it)."""
        self.callbacks.phase_begin(self, phase)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.callbacks.phase_end(self, phase, time.perf_counter() - started)

    def _load(self, path: Path) -> dict:
        """Load every stateful component from the checkpoint `path` (a resume, a rollback);
        returns its meta.json."""
        with self.phase(Phase.CHECKPOINT_LOAD):
            meta = load_checkpoint(path, self.checkpoint_state(), self.cfg)
        # A CPU job's next-forward all-gathers were issued from the values the load replaced (by
        # the last step, or by DCP's optimizer-state initialisation, which steps the optimizer
        # inside the load): freed, so that the next forward gathers the loaded ones.
        self.communication.discard_next_forward()
        self._apply_lr()
        return meta

    @property
    def iteration(self) -> int:
        """Global batches drawn so far, skipped ones included."""
        return self.state.iteration

    @property
    def step(self) -> int:
        """Optimizer steps applied."""
        return self.state.step

    def rewind(self, checkpoint: Path, lr_scale: float, ramp_steps: int) -> int:
        """A rollback's restore (`stability.recovery.Rewindable`): everything from `checkpoint` but
        the iteration counter and the guard's windows, then the learning-rate back-off."""
        iteration, windows = self.state.iteration, self.guard.windows()
        self._load(checkpoint)
        self.guard.keep_windows(windows)
        restored_iter, self.state.iteration = self.state.iteration, iteration
        self.lr_backoff.start(self.state.step, lr_scale, ramp_steps)
        self._apply_lr()
        return restored_iter

    def _apply_lr(self) -> None:
        # The schedule set the configured rates for the current step; a back-off scales them.
        self.lr_backoff.apply(self.optimizer, self.scheduler.get_last_lr(), self.state.step)

    def restore(self) -> list[dict]:
        """Load the resume checkpoint if there is one, else start from the init_from checkpoint
        if asked; returns the events to record."""
        self.checkpoints.remove_interrupted_saves()
        if self.resume_from is not None:
            meta = self._load(self.resume_from)
            self.recovery.resumed()
            resumed = [event(EventName.RESUME, checkpoint=str(self.resume_from), step=self.state.step,
                             iter=self.state.iteration)]
            replan = replanned(config_from_meta(meta, self.resume_from), self.cfg, self.state.step)
            if replan is not None and self.is_main:
                print(describe_replanned(replan), file=sys.stderr)
            return resumed + ([replan] if replan is not None else [])
        if self.init_from is not None:
            return self._start_phase()
        return []

    def _start_phase(self) -> list[dict]:
        """Load the `init_from` weights (and, with `checkpoint.init_optimizer`, the optimizer's
        state); everything else starts anew (checkpoint/init_from.py); returns the events."""
        state = {"model": ModelState(self.model)}
        if self.cfg.checkpoint.init_optimizer:
            state["optim"] = OptimizerState(self.model, self.optimizer)
        with self.phase(Phase.CHECKPOINT_LOAD):
            meta = load_checkpoint(self.init_from, state, self.cfg)
        self._apply_lr()  # the optimizer keeps its configured rates; the schedule's are the phase's
        return start_events(self.init_from, self._init_source, int(meta["step"]), self.cfg)

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

    def _start_events(self, events: list[dict]) -> list[dict]:
        events = [event(EventName.RUN_START, step=self.state.step, iter=self.state.iteration,
                        device=str(self.device), devices=self.dims.world_size,
                        resumed_from=str(self.resume_from) if self.resume_from else None)] + events
        if self.config_changes:
            events.insert(1, event(EventName.CONFIG_CHANGED, changes=[[k, a, b] for k, a, b in self.config_changes]))
        events[1:1] = [event(EventName.CHECKPOINT_PASSED_OVER, path=str(path), reason=reason)
                       for path, reason in self.checkpoints.passed_over]
        if self.is_main:  # the run goes on from an older checkpoint: say so where it is watched
            for path, reason in self.checkpoints.passed_over:
                print(f"warning: passed over the damaged checkpoint '{path}' ({reason}); resuming from "
                      f"'{self.resume_from}'", file=sys.stderr)
        return events + self.recovery.start_events()

    def start(self) -> None:
        """Restore, write the run directory, open the recorder and record the start; `run()`
        does this first (call it yourself only to drive `train_one_iteration`, then `finish`)."""
        self._started = time.perf_counter()
        self.watchdog.start(self)
        try:
            self._start()
        except BaseException:
            self.watchdog.stop()  # `finish()`, which stops it otherwise, never comes
            raise

    def _start(self) -> None:
        events = self.restore()
        # Checkpoints of steps after the start are a future this start abandons: never resumed.
        if moved := self.checkpoints.abandon_after(self.state.step, self.resume_from):
            events.append(event(EventName.CHECKPOINTS_ABANDONED, step=self.state.step,
                                checkpoints=[str(a) for a, _ in moved], moved_to=[str(b) for _, b in moved]))
        events += self._prepare_run_dir()
        self.recorder = MetricsRecorder(self.cfg, self.run_dir, start_step=self.state.step, is_main=self.is_main)
        self.recorder.events(self._start_events(events))
        self.throughput = Throughput(self.cfg, self.device, self.dims.world_size)
        self.summary = TrainSummary(self.run_dir, start_step=self.state.step, step=self.state.step,
                                    iteration=self.state.iteration)
        self.callbacks.on_start(self)

    def finish(self, status: str = ENDED) -> TrainSummary:
        """Complete the summary, tell the callbacks the run ended (`status`: records.ENDED, HALTED
        or FAILED), close the recorder and the timeline."""
        summary = self.summary
        summary.wall_s = time.perf_counter() - self._started
        summary.step, summary.iteration, summary.status = self.state.step, self.state.iteration, status
        with self.phase(Phase.SHUTDOWN):
            try:
                self.callbacks.on_end(self, summary)
            finally:
                self.recorder.close()
        self.timeline.close(self, status)
        return summary

    def run(self) -> TrainSummary:
        cfg = self.cfg
        self.start()
        status = FAILED
        try:
            if cfg.eval.every > 0 and self.resume_from is None and self.state.step < cfg.train.steps:
                self._validate()  # the starting point: about ln(vocab)
            while self.state.step < cfg.train.steps:
                self.train_one_iteration()
            if self.checkpoints.pending:
                with self.phase(Phase.CHECKPOINT_SAVE), self._saving():
                    self.checkpoints.wait()
            status = ENDED
        except TrainingDivergedError as e:
            status = HALTED
            self.callbacks.on_halt(self, e)
            raise
        finally:
            self.finish(status)
        return self.summary

    def train_one_iteration(self) -> None:
        """Draw the next global batch and train on it (or skip it, or roll back), then validate
        and checkpoint when due. Between `start()` and `finish()`."""
        self.timeline.iteration_begun()
        self.latest.begin()
        try:
            self._iterate()
        finally:  # an iteration that raised (a crash, a halt) is time spent too
            self.timeline.iteration_done(self, self.latest.batch_index, skipped=self.latest.skipped,
                                         failed=not self.latest.stepped)

    def _iterate(self) -> None:
        if self.checkpoints.pending:
            with self.phase(Phase.CHECKPOINT_SAVE), self._saving():
                self.checkpoints.poll()  # commits an asynchronous save whose write has finished
        started = time.perf_counter()
        with self.phase(Phase.DATA):
            batch = self.train_loader.next_batch()
            self.state.iteration += 1
            self.latest.batch_index = batch.index
            self.callbacks.before_step(self, batch)
        with self.phase(Phase.STEP):
            result = self.step_fn(batch, self.state.iteration, self.state.step)
            elapsed = time.perf_counter() - started
            self.recorder.events(result.verdict.events)
            applied = result.verdict.apply
            if applied:
                self.state.step += 1
                self.state.tokens_seen += result.tokens
            else:
                self.summary.skipped_steps += 1
                self.latest.skipped = True
            record = step_record(result, self.state, batch.index, self.throughput.of(result.tokens, elapsed))
            self.recovery.after_step(result, record, batch.index, self.recorder)
            self.callbacks.after_step(self, result, record)
        self.latest.stepped = True  # its record is written: whatever follows, the step happened
        self.summary.last_loss = result.loss
        if applied:
            self._after_applied_step()
        else:
            self._after_skipped_step(result, batch.index)
        self.callbacks.after_iteration(self)

    def _after_skipped_step(self, result: StepResult, batch_index: int) -> None:
        self.callbacks.on_skip(self, result, batch_index)
        rollback = self.recovery.respond(result, batch_index, self.recorder)
        if rollback is not None:
            self.summary.rollbacks += 1
            self.callbacks.on_rollback(self, rollback)

    def _after_applied_step(self) -> None:
        cfg, step = self.cfg, self.state.step
        if cfg.eval.every > 0 and (step % cfg.eval.every == 0 or step == cfg.train.steps):
            self._validate()
        if self.checkpoints.is_due(step) or (step == cfg.train.steps and cfg.checkpoint.every > 0):
            self._save()

    def _save(self) -> None:
        step, iteration = self.state.step, self.state.iteration
        self.recorder.events(self.faults.save_events(iteration, self.latest.batch_index))

        def committed(path: Path) -> None:
            self._failed_saves = 0
            self.callbacks.after_checkpoint(self, step, iteration, path)
        with self.phase(Phase.CHECKPOINT_SAVE):
            if self.checkpoints.pending:  # the asynchronous save before this one: its failure is its own
                with self._saving():
                    self.checkpoints.wait()
            with self._saving():
                self.checkpoints.save(step, self.checkpoint_state(), self.cfg, iteration=iteration,
                                      on_commit=committed)

    @contextlib.contextmanager
    def _saving(self):
        """A save that fails (on any rank; each raises) is recorded and training goes on with the
        checkpoints it has, up to `checkpoint.max_failed_saves` in a row; the final save's failure
        ends the run as a failure (no step is left to save again, and the final weights are nowhere)."""
        try:
            yield
        except CheckpointError as e:
            self._failed_saves += 1
            # The save that failed (an earlier asynchronous one may fail while a later step runs).
            if (self.checkpoints.saving_step or 0) >= self.cfg.train.steps:
                raise CheckpointError(f"{e}; the final checkpoint (step {self.state.step}) was not written: "
                                      f"{self._last_checkpoint_advice()}") from None
            if self._failed_saves >= self.cfg.checkpoint.max_failed_saves:
                raise
            self.recorder.event(event(EventName.CHECKPOINT_FAILED, step=self.checkpoints.saving_step,
                                      iter=self.state.iteration, error=str(e)))
            self.recorder.notice(f"warning: {e}; training goes on from the checkpoints already written "
                                 f"({self._failed_saves} failed save(s) in a row, the run stops at "
                                 f"{self.cfg.checkpoint.max_failed_saves})")

    def _last_checkpoint_advice(self) -> str:
        written = self.checkpoints.list()
        if not written:
            return ("this run has no checkpoint; free space and train again (the same --run.dir with "
                    "--checkpoint.resume=auto)")
        step, path = written[-1]
        return (f"the newest checkpoint is '{path}' (step {step}); free space and train the last "
                f"{self.state.step - step} step(s) again from it with --checkpoint.resume=auto")

    def _validate(self) -> None:
        with self.phase(Phase.VALIDATION):
            val = evaluate(self.model, self.val_loader, self.cfg, self.device, self.dims)
            passkey = self.passkey.run(self.model, self.cfg, self.device, self.dims) if self._passkey_due() else None
        self.recorder.validation(val_record(iter=self.state.iteration, step=self.state.step, val_loss=val.loss,
                                            val_ppl=math.exp(min(val.loss, 50.0)), val_tokens=val.tokens,
                                            val_position_starts=val.position_starts,
                                            val_loss_by_position=val.loss_by_position,
                                            val_tokens_by_position=val.tokens_by_position))
        if passkey is not None:
            self.recorder.passkey(passkey_record(iter=self.state.iteration, step=self.state.step,
                                                 **passkey.record_fields()))
        if self.summary.first_val_loss is None:
            self.summary.first_val_loss = val.loss
        self.summary.last_val_loss = val.loss

    def _passkey_due(self) -> bool:
        every = self.cfg.eval.passkey_every
        return self.passkey is not None and (self.state.step % every == 0 or self.state.step == self.cfg.train.steps)


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
        iter=state.iteration, step=state.step, batch=batch_index, aux_loss=result.aux_loss, z_loss=result.z_loss,
        lr=result.lrs.get("adamw", next(iter(result.lrs.values()))),
        lr_muon=result.lrs.get("muon"), tokens=result.tokens, tokens_seen=state.tokens_seen, **throughput,
        skipped=not result.verdict.apply, **signals.fields(result.signals, result.verdict.zscores),
        skip_reason=None if result.verdict.apply else result.verdict.reason,
        lr_scale=result.lr_scale if result.lr_scale != 1.0 else None, **expert_load_stats(result.tokens_per_expert))


def train(cfg: Config, callbacks: list[TrainerCallback] | None = None,
          gloo_overlap: GlooOverlap | None = None) -> TrainSummary:
    """Run (or resume) the training job `cfg` describes in this process, with `callbacks` attached
    to its loop; returns what it did. Under torchrun (see launch/) this process is one rank of the
    job. `gloo_overlap`: only a benchmark's ablation changes it (parallel/gloo)."""
    if world_size_from_env() == 1:
        dims = ParallelDims.from_config(cfg, 1)  # a layout one process cannot give, before the run directory
        with run_dir_owned(cfg.run.dir):  # before anything reads or writes the run directory
            return Trainer(cfg, dims, callbacks=callbacks).run()
    dims, device = init_distributed(cfg)  # rejects an impossible layout before joining
    try:
        with run_dir_owned(cfg.run.dir):  # rank 0 holds it for the job
            builder = functools.partial(build_model_for_training, dims=dims)
            summary = Trainer(cfg, dims, device, model_builder=builder, callbacks=callbacks,
                              gloo_overlap=gloo_overlap).run()
            leave_together()
        return summary
    finally:
        destroy_distributed()
