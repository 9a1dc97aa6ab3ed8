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
- `poison_repeat`: every token of the batch is `token`.

And what the machines do (`INFRA_FAULTS`), on the chosen rank(s) at the chosen iterations:

- `fail_save`: a checkpoint taken in the fault's iterations fails to write on the rank (an I/O
  error from the storage writer, after DCP planned the save with every rank): the run records a
  `checkpoint_failed` event, keeps its earlier checkpoints and trains on;
- `kill_rank`: the rank dies (SIGKILL, as a lost GPU or node) before the step: torchrun restarts
  the job, which resumes from its newest sound checkpoint;
- `hang_rank`: the rank stands still for `seconds` (default 3600, then it goes on) in the data
  phase before the step, while the others wait for it in the step's first collective: the hang
  watchdog (`health.watchdog`) names it, dumps its stacks and ends it restartably;
- `slow_rank`: the rank does `seconds` (default 1) of extra real work (matrix products on the
  CPU, for that long on the wall clock) in every iteration from `first` to `last`, in the data
  phase before the step: a straggler, for `health.straggler` to find.

Every fault that acts is reported as a `fault_injected` event, so nobody mistakes a drill for the
real thing: a numeric one by the process that writes the run directory (whichever rank it acts
on, and `fail_save`'s: `save_events`), a fault of its rank before the step (`kill_rank`,
`hang_rank`, `slow_rank`) by that rank, before it acts (`RunDir.append_event`: a killed rank has
said so already), with that rank. At its start every rank reads those events back (`FaultInjector.spend`): a machine fault an
earlier attempt injected at an iteration on a rank is spent there, so the restart it caused does
not meet it again.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

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
DEFAULT_SECONDS = {"hang_rank": 3600.0, "slow_rank": 1.0}
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


class StepFaults:
    """The hooks by which drills act inside a step (`step.TrainingStep`), one per place they act;
    each does nothing here, so a step without drills runs them as no-ops. `FaultInjector`
    implements them from the config's faults."""

    def scale_loss(self, ce_sum: torch.Tensor, iteration: int) -> torch.Tensor:
        """A micro-batch's summed cross entropy, as the step trains on it."""
        return ce_sum

    def scale_grads(self, params: list[torch.Tensor], iteration: int) -> None:
        """Act on this rank's gradients after the backward of every micro-batch."""

    def scale_lr(self, optimizer: torch.optim.Optimizer, iteration: int) -> bool:
        """Act on the update's learning rates; True if they were changed (the step then restores
        them when it is not applied)."""
        return False


class FailingWriter(dcp.FileSystemWriter):
    """A `fail_save` drill's storage writer: this rank's write fails with `error` after DCP has
    planned the save with every rank, so every rank learns of it as of a broken disk's."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(str(path))
        self.error = error

    def write_data(self, plan, planner):
        raise self.error


def _run_wide_event(fault: FaultConfig, iteration: int, batch_index: int) -> dict:
    """The `fault_injected` event of a numeric or save fault, recorded once for the run (rank: the
    drilled rank, or null where the drill acts on every rank)."""
    return event(EventName.FAULT_INJECTED, iter=iteration, batch=batch_index, fault=fault.fault,
                 rank=None if fault.rank < 0 else fault.rank,
                 factor=_factor(fault) if fault.fault in DEFAULT_FACTORS else None,
                 token=fault.token if fault.fault == "poison_repeat" else None)


def _covers(fault: FaultConfig, at: int) -> bool:
    last = fault.first if fault.last < 0 else fault.last
    return fault.first <= at <= last


def _factor(fault: FaultConfig) -> float:
    return fault.factor or DEFAULT_FACTORS[fault.fault]


def _seconds(fault: FaultConfig) -> float | None:
    return (fault.seconds or DEFAULT_SECONDS[fault.fault]) if fault.fault in DEFAULT_SECONDS else None


def kill_rank(fault: FaultConfig) -> None:
    """The `kill_rank` drill: this rank dies at once, as a lost GPU or node (no cleanup, no exit code)."""
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def hang_rank(fault: FaultConfig) -> None:
    """The `hang_rank` drill: this rank stands still for the fault's seconds (its stack, which the
    watchdog writes, names this function), then goes on."""
    deadline = time.monotonic() + _seconds(fault)
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def slow_rank(fault: FaultConfig) -> None:
    """The `slow_rank` drill: this rank's training thread does the fault's seconds of real work
    (256 x 256 matrix products) by its own CPU clock, the clock the rank statistics read, so the
    rank is that much slower however loaded the machine is (a wall-clock budget would shrink to
    the CPU share a busy machine leaves it); at most 10 s or 20 x that on the wall clock."""
    a = torch.ones(256, 256) / 256
    seconds = _seconds(fault)
    done_at = time.thread_time() + seconds
    give_up = time.perf_counter() + max(10.0, 20 * seconds)
    while time.thread_time() < done_at and time.perf_counter() < give_up:
        torch.mm(a, a)


# The machine faults that act in the data phase, before the step, and what each does.
BEFORE_STEP = {"kill_rank": kill_rank, "hang_rank": hang_rank, "slow_rank": slow_rank}


class FaultInjector(StepFaults):
    def __init__(self, faults: list[FaultConfig], rank: int, vocab_size: int):
        self.faults = list(faults)
        self.rank = rank
        self.vocab_size = vocab_size
        self.spent: set[tuple[str, int, int | None]] = set()  # (fault, iteration, rank) done before

    def spend(self, injected: list[dict]) -> None:
        """The machine faults among the run's `fault_injected` events `injected` (an earlier
        attempt's) acted already: they do not act again."""
        self.spent |= {(e["fault"], e["iter"], e["rank"]) for e in injected if e.get("fault") in INFRA_FAULTS}

    def machine_faults(self, iteration: int, acting: dict | None = None) -> list[FaultConfig]:
        """The machine faults (of `acting`, default all) that act on this rank at `iteration`
        and are not spent."""
        return [f for f in self.faults
                if f.fault in (INFRA_FAULTS if acting is None else acting) and self._here(f)
                and _covers(f, iteration) and not {(f.fault, iteration, self.rank), (f.fault, iteration, None)} & self.spent]

    def machine_event(self, fault: FaultConfig, iteration: int, batch_index: int) -> dict:
        """The `fault_injected` event of machine fault `fault` acting on this rank."""
        self.spent.add((fault.fault, iteration, self.rank))
        return event(EventName.FAULT_INJECTED, iter=iteration, batch=batch_index, fault=fault.fault, rank=self.rank,
                     seconds=_seconds(fault))

    def _here(self, fault: FaultConfig) -> bool:
        return fault.rank in (-1, self.rank)

    def events(self, iteration: int, batch_index: int) -> list[dict]:
        """The `fault_injected` events of the numeric faults of this iteration, on any rank (a
        machine fault's event is its rank's: `machine_event`)."""
        out = []
        for fault in self.faults:
            if fault.fault in INFRA_FAULTS:
                continue
            at = batch_index if fault.fault in POISON_FAULTS else iteration
            if _covers(fault, at):
                out.append(_run_wide_event(fault, iteration, batch_index))
        return out

    def save_events(self, iteration: int, batch_index: int) -> list[dict]:
        """The `fault_injected` events of a save taken at `iteration` that a `fail_save` breaks."""
        return [_run_wide_event(fault, iteration, batch_index)
                for fault in self.faults if fault.fault == "fail_save" and _covers(fault, iteration)]

    def storage_writer(self, path: Path, iteration: int) -> FailingWriter | None:
        """The storage writer of this rank's save of a checkpoint taken at `iteration` to `path`:
        one that fails with an I/O error where a `fail_save` drill covers it, else None (DCP's own)."""
        if any(f.fault == "fail_save" and self._here(f) and _covers(f, iteration) for f in self.faults):
            error = OSError(errno.EIO, f"input/output error (drill: fail_save at iteration {iteration})")
            return FailingWriter(path, error)
        return None

    def _step_factors(self, iteration: int) -> tuple[float, float, float]:
        """(loss, gradient, learning-rate) factors of the step faults acting on this rank."""
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
        return loss_factor, grad_factor, lr_factor

    def scale_loss(self, ce_sum: torch.Tensor, iteration: int) -> torch.Tensor:
        factor = self._step_factors(iteration)[0]
        return ce_sum * factor if factor != 1.0 else ce_sum

    def scale_grads(self, params: list[torch.Tensor], iteration: int) -> None:
        factor = self._step_factors(iteration)[1]
        if factor != 1.0:  # this rank's gradients blow up
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)

    def scale_lr(self, optimizer: torch.optim.Optimizer, iteration: int) -> bool:
        factor = self._step_factors(iteration)[2]
        if factor != 1.0:  # this update's learning rates are off by the factor
            for group in optimizer.param_groups:
                group["lr"] *= factor
        return factor != 1.0

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
    """The drills' part before a step: announce every numeric fault acting in this iteration (a
    `fault_injected` event and a console notice, on the main process whichever rank it acts on),
    then poison this rank's rows of the batch where a poison fault covers it; then the machine
    faults of `BEFORE_STEP` acting on this rank, each announced by this rank first. The step's own
    faults (loss, gradient and learning-rate factors) act inside `step.TrainingStep`, through the
    `StepFaults` hooks. At the start, the machine faults earlier attempts injected are spent."""

    def __init__(self, faults: FaultInjector):
        self.faults = faults

    def on_start(self, trainer) -> None:
        if any(f.fault in INFRA_FAULTS for f in self.faults.faults):
            self.faults.spend(trainer.rundir.read_events(EventName.FAULT_INJECTED))

    def before_step(self, trainer, batch) -> None:
        iteration = trainer.state.iteration
        drill = self.faults.events(iteration, batch.index)
        trainer.recorder.events(drill)
        for fault in drill:
            where = "" if fault["rank"] is None else f" on rank {fault['rank']}"
            trainer.recorder.notice(f"iteration {iteration}: drill: injected {fault['fault']}{where}")
        self.faults.poison(batch)
        for fault in self.faults.machine_faults(iteration, BEFORE_STEP):
            trainer.rundir.append_event(self.faults.machine_event(fault, iteration, batch.index))
            notice = f"iteration {iteration}: drill: injected {fault.fault} on rank {self.faults.rank}"
            if trainer.is_main:
                trainer.recorder.notice(notice)
            else:
                print(notice, file=sys.stderr, flush=True)
            BEFORE_STEP[fault.fault](fault)
