"""Fault drills (`stability.inject`): rehearse a spike, a rollback and a halt without writing code.

Each fault of the config acts at its iterations (transient faults: what a flaky device or an
overflow does at a moment) or on its global batches (poisoned data: what is in the data, so it
comes back if those batches are drawn again), on one rank or on all:

- `nan_loss`: the step's loss (and so its gradients) is NaN;
- `loss_spike`: the loss, and with it the gradients, is multiplied by `factor` (default 10);
- `grad_scale`: the gradients are multiplied by `factor` (default 1000) after backward, the loss
  stays flat;
- `lr_scale`: the step's learning rates are multiplied by `factor` (default 20): a learning rate
  set too high from `first` on (give `last` for how long), whose damage the guard sees one step
  late, in the loss the update made;
- `poison_random`: the batch's tokens are replaced by uniformly random ones (seeded by the batch
  index, so every drill run sees the same poison);
- `poison_repeat`: every token of the batch is `token`;
- `slow_rank`: the rank does `seconds` (default 1) of extra real work (matrix products on the
  CPU, for that long on the wall clock) in every iteration from `first` to `last`, in the data
  phase before the step: a straggler, for `health.straggler` to find.

And what the machines do:

- `fail_save`: a checkpoint taken in the fault's iterations fails to write on the rank (an I/O
  error from the storage writer, after DCP planned the save with every rank): the run records a
  `checkpoint_failed` event, keeps its earlier checkpoints and trains on.

Every fault that acts is reported as a `fault_injected` event by the process that writes the run
directory (whichever rank it acts on), so nobody mistakes a drill for the real thing.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass

import torch

from trinity_train.callbacks import TrainerCallback
from trinity_train.config import Config, FaultConfig, one_of, require
from trinity_train.records import EventName, event

NUMERIC_FAULTS = ("nan_loss", "grad_scale", "loss_spike", "lr_scale", "poison_random", "poison_repeat")
# What the machines do, not the numbers: a rank killed, standing still, slow; a save that fails.
# Each acts once per run (an earlier attempt's `fault_injected` event spends it), so the restart
# it causes does not meet it again.
INFRA_FAULTS = ("kill_rank", "hang_rank", "slow_rank", "fail_save")
FAULTS = NUMERIC_FAULTS + INFRA_FAULTS
POISON_FAULTS = ("poison_random", "poison_repeat")  # act on global batches, not iterations
DEFAULT_FACTORS = {"loss_spike": 10.0, "grad_scale": 1000.0, "lr_scale": 20.0}
DEFAULT_SECONDS = {"slow_rank": 1.0, "hang_rank": 3600.0}
STEP_FAULTS = ("nan_loss", "loss_spike", "grad_scale", "lr_scale")  # act inside the step


def check_fault_config(cfg: Config) -> None:
    """Each drill of `stability.inject` names a known fault, where it acts (an iteration >= 1, or
    a global batch index >= 0 for poison), on which rank, and a token the vocabulary has
    (ConfigError naming the key); `run_config.validate_rules` runs this at load."""
    for i, f in enumerate(cfg.stability.inject):
        key = f"stability.inject[{i}]"
        one_of(f.fault, FAULTS, f"{key}.fault")
        poison = f.fault in POISON_FAULTS
        require(f.first >= (0 if poison else 1), f"{key}.first",
                f"must be {'a global batch index >= 0' if poison else 'an iteration >= 1'}, got {f.first}")
        require(f.last == -1 or f.last >= f.first, f"{key}.last", f"must be -1 or >= first ({f.first})")
        require(f.rank >= -1, f"{key}.rank", "must be a rank >= 0, or -1 for every rank")
        require(f.factor >= 0, f"{key}.factor", "must be >= 0 (0: the fault's default)")
        require(f.seconds >= 0, f"{key}.seconds", "must be >= 0 (0: the fault's default)")
        require(0 <= f.token < cfg.model.vocab_size, f"{key}.token",
                f"must be a token id below model.vocab_size ({cfg.model.vocab_size})")


@dataclass(frozen=True)
class StepFaults:
    """What the drills do to one step on this rank."""

    loss_factor: float = 1.0  # multiplies the summed cross entropy (NaN for nan_loss)
    grad_factor: float = 1.0  # multiplies the gradients after backward
    lr_factor: float = 1.0  # multiplies the learning rates of the update

    @property
    def any(self) -> bool:
        return self.loss_factor != 1.0 or self.grad_factor != 1.0 or self.lr_factor != 1.0


def _covers(fault: FaultConfig, at: int) -> bool:
    last = fault.first if fault.last < 0 else fault.last
    return fault.first <= at <= last


def _factor(fault: FaultConfig) -> float:
    return fault.factor or DEFAULT_FACTORS[fault.fault]


def _seconds(fault: FaultConfig) -> float:
    return fault.seconds or DEFAULT_SECONDS[fault.fault]


def busy_work(seconds: float) -> None:
    """Real work for `seconds` of wall clock: 256 x 256 matrix products (about a millisecond each
    on one core), on every thread torch computes with, as a slow rank's own compute would be."""
    a = torch.ones(256, 256) / 256
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, a)


class FaultInjector:
    def __init__(self, faults: list[FaultConfig], rank: int, vocab_size: int):
        self.faults = list(faults)
        self.rank = rank
        self.vocab_size = vocab_size

    def _here(self, fault: FaultConfig) -> bool:
        return fault.rank in (-1, self.rank)

    def events(self, iteration: int, batch_index: int) -> list[dict]:
        """The `fault_injected` events of this iteration, on any rank."""
        out = []
        for fault in self.faults:
            at = batch_index if fault.fault in POISON_FAULTS else iteration
            if fault.fault != "fail_save" and _covers(fault, at):
                out.append(event(EventName.FAULT_INJECTED, iter=iteration, batch=batch_index, fault=fault.fault,
                                 rank=None if fault.rank < 0 else fault.rank,
                                 factor=_factor(fault) if fault.fault in DEFAULT_FACTORS else None,
                                 token=fault.token if fault.fault == "poison_repeat" else None,
                                 seconds=_seconds(fault) if fault.fault in DEFAULT_SECONDS else None))
        return out

    def slow_seconds(self, iteration: int) -> float:
        """The extra seconds of work the `slow_rank` drills give this rank in `iteration`."""
        return sum(_seconds(f) for f in self.faults
                   if f.fault == "slow_rank" and self._here(f) and _covers(f, iteration))

    def save_events(self, iteration: int, batch_index: int) -> list[dict]:
        """The `fault_injected` events of a save taken at `iteration` that a `fail_save` breaks."""
        return [event(EventName.FAULT_INJECTED, iter=iteration, batch=batch_index, fault=fault.fault,
                      rank=None if fault.rank < 0 else fault.rank, factor=None, token=None)
                for fault in self.faults if fault.fault == "fail_save" and _covers(fault, iteration)]

    def failing_save(self, iteration: int) -> OSError | None:
        """The I/O error this rank's write of a checkpoint taken at `iteration` fails with (a
        `fail_save` drill covering it), or None."""
        if any(f.fault == "fail_save" and self._here(f) and _covers(f, iteration) for f in self.faults):
            return OSError(errno.EIO, f"input/output error (drill: fail_save at iteration {iteration})")
        return None

    def step_faults(self, iteration: int) -> StepFaults:
        loss_factor, grad_factor, lr_factor = 1.0, 1.0, 1.0
        for fault in self.faults:
            if fault.fault not in STEP_FAULTS or not self._here(fault) or not _covers(fault, iteration):
                continue
            if fault.fault == "nan_loss":
                loss_factor = float("nan")
            elif fault.fault == "loss_spike":
                loss_factor *= _factor(fault)
            elif fault.fault == "lr_scale":
                lr_factor *= _factor(fault)
            else:
                grad_factor *= _factor(fault)
        return StepFaults(loss_factor, grad_factor, lr_factor)

    def poison(self, batch) -> None:
        """Replace this rank's rows of `batch` (in place) where a poison fault covers its index."""
        for fault in self.faults:
            if fault.fault not in POISON_FAULTS or not self._here(fault) or not _covers(fault, batch.index):
                continue
            rows, length = batch.input_ids.shape
            if fault.fault == "poison_random":
                generator = torch.Generator().manual_seed(1_000_003 * batch.index + self.rank)
                tokens = torch.randint(0, self.vocab_size, (rows, length + 1), generator=generator)
            else:
                tokens = torch.full((rows, length + 1), fault.token, dtype=torch.long)
            batch.input_ids.copy_(tokens[:, :-1])
            batch.labels.copy_(tokens[:, 1:])


class DrillCallback(TrainerCallback):
    """The drills' part before a step: announce every fault acting in this iteration (a
    `fault_injected` event and a console notice, on the main process whichever rank it acts on),
    then poison this rank's rows of the batch where a poison fault covers it, and do a slow
    rank's extra work. The step's own faults (loss and gradient factors) act inside
    `step.TrainingStep`."""

    def __init__(self, faults: FaultInjector):
        self.faults = faults

    def before_step(self, trainer, batch) -> None:
        iteration = trainer.state.iteration
        drill = self.faults.events(iteration, batch.index)
        trainer.recorder.events(drill)
        for fault in drill:
            where = "" if fault["rank"] is None else f" on rank {fault['rank']}"
            trainer.recorder.notice(f"iteration {iteration}: drill: injected {fault['fault']}{where}")
        self.faults.poison(batch)
        if seconds := self.faults.slow_seconds(iteration):
            busy_work(seconds)
