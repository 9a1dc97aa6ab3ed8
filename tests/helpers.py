"""Shared test helpers."""

from pathlib import Path

from trinity_train.callbacks import TrainerCallback


class StopWhen(TrainerCallback):
    """Raise `error` at the end of the first iteration after which `condition(trainer)` holds,
    as a process killed there would leave the run (files written, an async save in flight)."""

    def __init__(self, condition, error: type[BaseException]):
        self.condition, self.error = condition, error

    def after_iteration(self, trainer):
        if self.condition(trainer):
            raise self.error()


class PoisonBatches(TrainerCallback):
    """Every step of the trainer on one of the global batches `poisoned` produces a non-finite
    loss, as a hardware fault or a bad batch would (the loss is NaN on this rank, so globally)."""

    def __init__(self, poisoned: set[int]):
        self.poisoned, self.index = poisoned, -1

    def on_start(self, trainer):
        forward = trainer.model.forward

        def poisoned_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if self.index in self.poisoned:
                out.ce_sum = out.ce_sum * float("nan")
            return out

        trainer.model.forward = poisoned_forward

    def before_step(self, trainer, batch):
        self.index = batch.index


def poison_batches(trainer, poisoned: set[int]) -> None:
    """Attach `PoisonBatches(poisoned)` to `trainer`."""
    trainer.add_callback(PoisonBatches(poisoned))


def assert_values_close(got, want, rel: float, path: str = "record") -> None:
    """`got` equals `want` member by member (dicts, lists, nulls, ints exactly), floats within
    `rel` relative difference; the message names the first member that differs."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys {got} vs {want}"
        for key in want:
            assert_values_close(got[key], want[key], rel, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} vs {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_values_close(g, w, rel, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) <= rel * abs(want), f"{path}: {got} vs {want}"
    else:
        assert got == want, f"{path}: {got} vs {want}"


def flip_byte(file: Path, offset: int) -> None:
    """Damage `file` as a bad disk would: one bit of the byte at `offset` flipped."""
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


class StopAfterStep(Exception):
    pass


def stop_after(step: int) -> StopWhen:
    """A callback that makes the trainer die right after it finishes `step` (and saves its
    checkpoint)."""
    return StopWhen(lambda trainer: trainer.state.step == step, StopAfterStep)
