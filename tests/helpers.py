"""Shared test helpers."""

import random
from pathlib import Path

from trinity_train.data.prepare import PrepareOptions, prepare
from trinity_train.train import Trainer


def prepare_word_corpus(root: Path, words: list[str], *, seed: int, num_docs: int,
                        words_per_doc: int = 300):
    """Prepare a tiny corpus of seeded word salad (a 300-token BPE, 10% held out) under `root`."""
    rng = random.Random(seed)
    docs = root / "docs"
    docs.mkdir()
    for i in range(num_docs):
        (docs / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(words_per_doc)))
    return prepare(PrepareOptions(inputs=[str(docs)], out=str(root / "prepared"), train_tokenizer=300,
                                  val_fraction=0.1, progress=False))


def poison_batches(trainer, poisoned: set[int]) -> None:
    """Make every step of `trainer` on one of the global batches `poisoned` produce a non-finite
    loss, as a hardware fault or a bad batch would (the loss is NaN on this rank, so globally)."""
    step, forward = trainer.step_fn, trainer.model.forward
    current = {"index": -1}

    def stepping(batch, *args):
        current["index"] = batch.index
        return step(batch, *args)

    def poisoned_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if current["index"] in poisoned:
            out.ce_sum = out.ce_sum * float("nan")
        return out

    trainer.step_fn = stepping
    trainer.model.forward = poisoned_forward


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


def stop_at(monkeypatch, step: int) -> None:
    """Make the trainer die right after it finishes `step` (and saves its checkpoint)."""
    original = Trainer._one_iteration

    def one_iteration(self, *args):
        original(self, *args)
        if self.state.step == step:
            raise StopAfterStep()

    monkeypatch.setattr(Trainer, "_one_iteration", one_iteration)
