"""The datatrove steps of `prepare-data`: a task reads its slice of the inputs and writes their
documents, tokenized, into shards of its own.

Files go to tasks round-robin over the sorted input list (task r of N reads files r, r+N, ...), as
datatrove's own readers slice a folder, so the token order is a function of the inputs and N alone.
A document is held out for validation when a seeded hash of its text falls below the fraction: a
decision per document that needs no view of the whole corpus (and puts identical copies on the
same side, so no duplicate straddles train and val). A task ends by writing its task record (its
shards' records and what it read); datatrove marks the task completed only after that, so a rerun
skips it, and the manifest step (prepare.py) reads the records of every task.

datatrove's JsonlReader, ParquetReader and CsvReader cover three of our formats but not JSON array
files, plain text by document/paragraph/line, or our per-record diagnosis (file:line and
--skip-bad-records), so the reader step reads through documents.py, the one reader of the inputs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from loguru import logger
from tokenizers import Tokenizer

from trinity_train.data.documents import TEXT, Inputs, load_documents
from trinity_train.data.shards import SPLITS, TokenSizedShards
from trinity_train.files import atomic_write_json

ENCODE_BATCH = 1024  # documents per encode_batch call (benchmarks/tokenize_throughput.py)
_READ_BATCH = 8192
# Fault injection for the rerun tests: the task of this number SIGKILLs its process group (the run's
# processes, when prepare-data was started in a session of its own) right after finishing its first
# shard, as a node lost mid-task would leave it.
KILL_TASK_ENV = "TRINITY_PREPARE_KILL_TASK"


def task_record_path(records_dir: Path, task: int) -> Path:
    return records_dir / f"{task:05d}.json"


def read_report_path(records_dir: Path, task: int) -> Path:
    return records_dir / f"{task:05d}.read.json"


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    skip_bad_records: bool = False
    sample_by: str = "document"
    encoding_errors: str = "strict"


def task_inputs(inputs: Inputs, task: int, tasks: int) -> Inputs:
    """The inputs task `task` of `tasks` reads: every tasks-th file from its own; a hub dataset
    (one stream, not files) is read by task 0 alone."""
    if inputs.hub_name:
        return inputs if task == 0 else Inputs()
    return Inputs(files=inputs.files[task::tasks])


def is_validation(texts: list[str], seed: int, fraction: float) -> np.ndarray:
    """Per document: does a seeded 64-bit blake2b of its text fall below `fraction` of the range?"""
    if fraction <= 0:
        return np.zeros(len(texts), dtype=bool)
    key = seed.to_bytes(8, "little", signed=True)
    threshold = int(fraction * 2**64)
    return np.fromiter((int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8,
                                                       key=key).digest(), "little") < threshold
                        for t in texts), dtype=bool, count=len(texts))


def datatrove_logging(on: bool) -> None:
    """datatrove logs every task to the console (and a traceback for a failed one); without
    progress output that is off, so that a failure reaches the user once, as the CLI's one line.
    (loguru's switch is per process: the reader step sets it again in each worker process.)"""
    (logger.enable if on else logger.disable)("datatrove")


class ReadInputs(PipelineStep):
    """Yields the documents of this task's input files, in order; writes what it skipped."""

    name = "read inputs (documents.py)"
    type = "📖 - READER"

    def __init__(self, inputs: Inputs, read: ReadOptions, work_dir: Path, records_dir: Path, console: bool):
        super().__init__()
        self.inputs, self.read, self.work_dir, self.records_dir = inputs, read, work_dir, records_dir
        self.console = console

    def __setstate__(self, state: dict) -> None:  # in a worker process, before its task starts
        self.__dict__.update(state)
        if not self.console:  # (a copy in this process, as SLURM's launch makes, changes nothing)
            datatrove_logging(False)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        mine = task_inputs(self.inputs, rank, world_size)
        bad_records, bad_examples = 0, []
        if mine.files or mine.hub_name:
            cache = Path(tempfile.mkdtemp(prefix=f".work-task{rank:05d}-", dir=self.work_dir))
            try:
                docs, report = load_documents(mine, cache_dir=cache, **asdict(self.read))
                bad_records, bad_examples = report.bad_records, report.bad_examples
                number = 0
                for batch in docs.iter(batch_size=_READ_BATCH):
                    for text in batch[TEXT]:
                        yield Document(text=text, id=f"{rank}/{number}")
                        number += 1
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        self.stat_update("bad_records", value=bad_records)
        atomic_write_json(read_report_path(self.records_dir, rank),
                          {"bad_records": bad_records, "bad_examples": bad_examples})


@dataclass(frozen=True)
class ShardOptions:
    out: Path
    build_key: str
    dtype: str  # numpy dtype string of the token files
    shard_tokens: int
    val_fraction: float
    seed: int


class TokenizeToShards(PipelineStep):
    """Tokenizes the task's documents (EOS appended) and writes them to its train and val shards,
    then the task record."""

    name = "tokenize to shards"
    type = "🔢 - TOKENIZER"

    def __init__(self, tokenizer_json: str, eos_id: int, shards: ShardOptions, records_dir: Path):
        super().__init__()
        self.tokenizer_json, self.eos_id, self.shards, self.records_dir = tokenizer_json, eos_id, shards, records_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        encoder = DocumentEncoder(self.tokenizer_json, self.eos_id, np.dtype(self.shards.dtype))
        o = self.shards
        kill = os.environ.get(KILL_TASK_ENV) == str(rank)
        writers = {split: TokenSizedShards(o.out / split, rank, np.dtype(o.dtype), o.build_key, o.shard_tokens,
                                           on_finished=_kill_self if kill else None) for split in SPLITS}
        try:
            batch: list[str] = []
            for document in data or ():
                if document.text:  # an empty document has no tokens at all (not a lone EOS)
                    batch.append(document.text)
                if len(batch) == ENCODE_BATCH:
                    self._write(batch, encoder, writers)
                    batch = []
            if batch:
                self._write(batch, encoder, writers)
            records = {split: writers[split].finish() for split in SPLITS}
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        atomic_write_json(task_record_path(self.records_dir, rank),
                          {"task": rank, "tasks": world_size, "build_key": o.build_key,
                           "host": socket.gethostname(), "splits": records})
        return
        yield  # a generator step, like every datatrove step

    def _write(self, texts: list[str], encoder: "DocumentEncoder", writers: dict) -> None:
        held_out = is_validation(texts, self.shards.seed, self.shards.val_fraction)
        for split, chosen in (("train", ~held_out), ("val", held_out)):
            if chosen.any():
                tokens, lengths = encoder([t for t, c in zip(texts, chosen) if c])
                with self.track_time(unit="batch"):
                    writers[split].add(tokens, lengths)
                self.stat_update("documents", value=len(lengths))
                self.stat_update("tokens", value=int(lengths.sum()))


def _kill_self(record: dict) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


class DocumentEncoder:
    """Texts -> (their ids, each document followed by EOS, as one array; each document's length).

    `encode_batch_fast` (no character offsets, which the shards do not keep) and one list of ids
    turned into an array at once: benchmarks/tokenize_throughput.py measures what this costs over
    the bare tokenizer."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: np.dtype):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.eos_id, self.dtype = eos_id, dtype

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids: list[int] = []
        lengths = np.empty(len(texts), dtype=np.int64)
        for i, encoding in enumerate(self.tokenizer.encode_batch_fast(texts)):
            doc = encoding.ids
            ids.extend(doc)
            ids.append(self.eos_id)
            lengths[i] = len(doc) + 1
        return np.array(ids, dtype=self.dtype), lengths
