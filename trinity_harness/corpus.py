"""A tiny prepared corpus for training runs of the tests and benchmarks."""

from __future__ import annotations

import random
from pathlib import Path

from trinity_train.data.prepare import PrepareOptions, prepare


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
