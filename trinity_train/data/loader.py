"""Deterministic, resumable, data-parallel batches from prepared datasets.

A split is cut into fixed-length sequences: sequence j is tokens [j*L, j*L + L + 1) (L inputs and
their next-token labels; neighbours share one token). Global batch *i* is samples
[i*G, (i+1)*G) of the stream `mixing.py` defines (G = micro_batch_size * grad_accum * dp_size, or
`train.global_batch_size`, which fixes G for every layout),
and data-parallel rank r reads rows [r*R, (r+1)*R) of it (R = G / dp_size). So a batch is a pure
function of (manifests, seed, i): the loader's whole state is its position, `skip(n)` is O(1), and
resuming with another dp_size (same G) gives the same global batches. If G itself changes at a
resume, the stream continues from the number of samples already consumed, so no sample is
repeated or lost either way.

Batch indices listed in the skip ledger or in `data.skip_ranges` are never produced: the loader
jumps over them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trinity_train.config import Config, DataConfig, rows_per_rank
from trinity_train.data.default_corpus import default_dataset, default_dataset_dir
from trinity_train.data.ledger import SkipLedger
from trinity_train.data.mixing import SAMPLE_ORDER, MixSchedule, StatelessOrder
from trinity_train.data.shards import PreparedDataset, TokenSplit
from trinity_train.errors import DataError
from trinity_train.rundir import RunDir


@dataclass
class Batch:
    """This rank's rows of one global batch; every tensor is [rows, seq_len] int64."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # input_ids shifted left by one: the next token at each position
    position_ids: torch.Tensor  # doc_masking: restart at 0 at the row and each document start; else arange
    document_ids: torch.Tensor  # 0, 1, ... for the documents a row touches, in order
    index: int  # the global batch index (training) or validation batch number


class SequenceReader:
    """Turns sequence numbers of one split into model rows."""

    def __init__(self, split: TokenSplit, seq_len: int, doc_positions: bool):
        self.split, self.seq_len, self.doc_positions = split, seq_len, doc_positions
        self.num_sequences = max(0, (split.num_tokens - 1) // seq_len)

    def rows(self, sequences: np.ndarray, out: dict[str, np.ndarray], row_ids: np.ndarray) -> None:
        """Fill rows `row_ids` of the arrays in `out` with these sequences."""
        L = self.seq_len
        for row, seq in zip(row_ids.tolist(), sequences.tolist()):
            start = seq * L
            tokens = self.split.read(start, L + 1)
            out["input_ids"][row] = tokens[:-1]
            out["labels"][row] = tokens[1:]
            # A row's first document counts from the row start, as the model's own default does
            # (RoPE is relative, so only positions within one document matter).
            doc_starts = np.maximum(self.split.document_starts(start, start + L), start)
            positions = np.arange(start, start + L)
            doc = np.searchsorted(doc_starts, positions, side="right") - 1
            out["document_ids"][row] = doc
            out["position_ids"][row] = positions - doc_starts[doc] if self.doc_positions else positions - start


def _empty_rows(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    return {k: np.empty((rows, seq_len), dtype=np.int64)
            for k in ("input_ids", "labels", "position_ids", "document_ids")}


def _to_batch(arrays: dict[str, np.ndarray], index: int) -> Batch:
    return Batch(**{k: torch.from_numpy(v) for k, v in arrays.items()}, index=index)


class _MixedRows:
    """Reads stream samples -> rows, for a set of sources and their schedule."""

    def __init__(self, readers: list[SequenceReader], schedule: MixSchedule, datasets: list[PreparedDataset],
                 shuffled: bool = True, seed: int = 0):
        """`shuffled`: each source's sequences in the seeded sample order (training); else in
        order (validation)."""
        self.readers, self.schedule, self.datasets, self.seed = readers, schedule, datasets, seed
        self.vocab_size = min(ds.vocab_size for ds in datasets)
        self.orders = [StatelessOrder(r.num_sequences, seed, k) for k, r in enumerate(self.readers)] if shuffled else None

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.schedule.locate(samples)

    def origins(self, samples: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
        """(source, offset of the sample's first token in that source's split) of each sample."""
        source, index = self.locate(samples)
        starts = np.empty(len(samples), dtype=np.int64)
        for k in np.unique(source).tolist():
            rows = np.flatnonzero(source == k)
            starts[rows] = (self.orders[k].sequences(index[rows]) if self.orders else index[rows]) * seq_len
        return list(zip(source.tolist(), starts.tolist()))

    def read(self, samples: np.ndarray, seq_len: int, batch: str) -> dict[str, np.ndarray]:
        source, index = self.locate(samples)
        out = _empty_rows(len(samples), seq_len)
        for k in np.unique(source).tolist():
            rows = np.flatnonzero(source == k)
            seqs = self.orders[k].sequences(index[rows]) if self.orders else index[rows]
            self.readers[k].rows(seqs, out, rows)
        self._check_ids(out, source, batch)
        return out

    def _check_ids(self, out: dict[str, np.ndarray], source: np.ndarray, batch: str) -> None:
        """The start-up check trusts a manifest's recorded largest id when checksums are off; a
        shard changed since would fail inside the embedding (an IndexError, or a device-side
        assert on a GPU). Two max() over the batch's ids cost microseconds next to a step."""
        if max(out["input_ids"].max(), out["labels"].max()) < self.vocab_size:
            return
        bad = (out["input_ids"] >= self.vocab_size) | (out["labels"] >= self.vocab_size)
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        token = int(max(out["input_ids"][row].max(), out["labels"][row].max()))
        ds = self.datasets[int(source[row])]
        raise DataError(f"{batch} holds token id {token} (row {row}, from dataset '{ds.path}'), outside its "
                        f"tokenizer's vocabulary of {self.vocab_size}, though the manifest records no id that "
                        "large: the shards changed after they were prepared or are damaged; prepare the dataset "
                        "again (data.verify_checksums=\"full\" or \"stamp\" finds a changed shard before training)")


class TrainLoader:
    """This rank's training batches; its state is a position in the global batch sequence."""

    def __init__(self, mixed: _MixedRows, seq_len: int, rows_per_rank: int, dp_rank: int, dp_size: int,
                 seed: int, fingerprint: str, skips: list[SkipLedger]):
        self._mixed, self.seq_len = mixed, seq_len
        self.rows_per_rank, self.dp_rank, self.dp_size = rows_per_rank, dp_rank, dp_size
        self.global_batch_size = rows_per_rank * dp_size
        self.seed, self.fingerprint, self.skips = seed, fingerprint, skips
        self._position = 0
        # Batch i starts at sample anchor_sample + (i - anchor_batch) * G; (0, 0) unless a resume
        # changed the global batch size.
        self._anchor_batch, self._anchor_sample = 0, 0

    @property
    def position(self) -> int:
        """Global batches consumed (skipped ones included): the index of the next batch."""
        return self._position

    def _first_sample(self, index: int) -> int:
        if index < self._anchor_batch:
            raise ValueError(f"batch {index} precedes this run's resume point {self._anchor_batch}")
        return self._anchor_sample + (index - self._anchor_batch) * self.global_batch_size

    def _next_allowed(self, index: int) -> int:
        while True:
            moved = index
            for ledger in self.skips:
                moved = ledger.next_allowed(moved)
            if moved == index:
                return index
            index = moved

    def batch_at(self, index: int) -> Batch:
        """This rank's rows of global batch `index` (ignores skips and does not move)."""
        first = self._first_sample(index) + self.dp_rank * self.rows_per_rank
        samples = np.arange(first, first + self.rows_per_rank, dtype=np.int64)
        return _to_batch(self._mixed.read(samples, self.seq_len, f"training batch {index}"), index)

    def row_origins(self, index: int) -> list[tuple[int, int]]:
        """Where every row of global batch `index` (all ranks' rows) starts: (source, token offset
        in that source's training split), in row order."""
        first = self._first_sample(index)
        return self._mixed.origins(np.arange(first, first + self.global_batch_size, dtype=np.int64),
                                   self.seq_len)

    def split(self, source: int) -> TokenSplit:
        """The training split of source `source` (in `data.mix` order)."""
        return self._mixed.readers[source].split

    @property
    def dataset_dirs(self) -> list[Path]:
        """The prepared dataset directories it reads, in `data.mix` order."""
        return [ds.path for ds in self._mixed.datasets]

    def next_batch(self) -> Batch:
        index = self._next_allowed(self._position)
        batch = self.batch_at(index)
        self._position = index + 1
        return batch

    def skip(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot skip a negative number of batches ({n})")
        self._position += n

    def state_dict(self) -> dict:
        # "version" is the sample order's (`mixing.SAMPLE_ORDER`): every state written before order
        # 2 existed says 1, and a checkpoint (DCP) loads only the keys it has, so no key was added.
        return {"version": SAMPLE_ORDER, "position": self._position,
                "samples_consumed": self._first_sample(self._position),
                "global_batch_size": self.global_batch_size, "anchor_batch": self._anchor_batch,
                "anchor_sample": self._anchor_sample, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(f"the checkpoint's data position belongs to other data (fingerprint "
                            f"{state.get('fingerprint')}, this run: {self.fingerprint}); resume with the same "
                            "datasets, mix and seq_len, or start a new run")
        if state.get("seed") != self.seed:
            raise DataError(f"the checkpoint was trained with data.seed={state.get('seed')}, this run has "
                            f"data.seed={self.seed}; resume with the same seed")
        order = state.get("version", 1)
        if order != SAMPLE_ORDER:
            raise DataError(f"the checkpoint's data position is in sample order {order!r}, which this version no "
                            f"longer reads (only {SAMPLE_ORDER}, the stateless order): finish that run with the "
                            "version that wrote it, or continue its weights in a new run (checkpoint.init_from)")
        position = int(state["position"])
        if int(state["global_batch_size"]) == self.global_batch_size:
            self._anchor_batch, self._anchor_sample = int(state["anchor_batch"]), int(state["anchor_sample"])
        else:  # a new global batch size: continue the stream where the old run stopped
            self._anchor_batch, self._anchor_sample = position, int(state["samples_consumed"])
        self._position = position


class ValidationLoader:
    """Validation batches: the validation splits read in order (mixed by the first weights)."""

    def __init__(self, mixed: _MixedRows, seq_len: int, rows_per_rank: int, dp_rank: int, dp_size: int):
        self._mixed, self.seq_len = mixed, seq_len
        self.rows_per_rank, self.dp_rank = rows_per_rank, dp_rank
        self.global_batch_size = rows_per_rank * dp_size

    def _batch_is_available(self, j: int) -> bool:
        source, index = self._mixed.locate(np.arange(j * self.global_batch_size,
                                                     (j + 1) * self.global_batch_size))
        limits = np.array([r.num_sequences for r in self._mixed.readers])
        return bool(np.all(index < limits[source]))

    def num_batches(self, limit: int) -> int:
        """How many of the first `limit` global validation batches the splits can fill."""
        n = 0
        while n < limit and self._batch_is_available(n):
            n += 1
        return n

    def batches(self, n: int):
        """The first n validation batches (fewer if the validation data runs out); same every call."""
        for j in range(self.num_batches(n)):
            first = j * self.global_batch_size + self.dp_rank * self.rows_per_rank
            samples = np.arange(first, first + self.rows_per_rank, dtype=np.int64)
            yield _to_batch(self._mixed.read(samples, self.seq_len, f"validation batch {j}"), j)


# ---------------------------------------------------------------------------- building


def dataset_dirs(data: DataConfig, build_default: bool = True) -> list[Path]:
    """The prepared dataset directories a run trains on, in `data.mix` order. The embedded
    default corpus is built on first use unless `build_default` is off."""
    if data.mix:
        return [Path(s.path).expanduser() for s in data.mix]
    if data.path:
        return [Path(data.path).expanduser()]
    return [default_dataset(data) if build_default else default_dataset_dir(data)]


def _sources(cfg: Config) -> list[tuple[Path, float]]:
    weights = [s.weight for s in cfg.data.mix] or [1.0]
    return list(zip(dataset_dirs(cfg.data), weights))


def _phases(cfg: Config, weights: list[float]) -> list[tuple[int, list[float]]]:
    """(first sample, weights) per phase; phase starts are given in tokens."""
    phases = [(0, weights)]
    for p in cfg.data.phases:
        phases.append((p.start_tokens // cfg.data.seq_len, list(p.weights)))
    return phases


def _fingerprint(datasets: list[PreparedDataset], phases: list, seq_len: int) -> str:
    payload = {"datasets": [d.fingerprint for d in datasets], "phases": phases, "seq_len": seq_len}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def check_token_ids(ds: PreparedDataset, model_vocab_size: int) -> None:
    """Every token id of `ds` must index the model's embedding (and lie in the dataset's own
    vocabulary): an id out of range would fail deep inside the first forward that reads it (an
    IndexError on the CPU, a device-side assert on a GPU), after the run directory was written."""
    if ds.vocab_size > model_vocab_size:
        raise DataError(f"dataset '{ds.path}' has a vocabulary of {ds.vocab_size} tokens but "
                        f"model.vocab_size is {model_vocab_size}; set --model.vocab_size={ds.vocab_size}")
    largest = ds.max_token_id if ds.max_token_id is not None else -1
    if largest >= ds.vocab_size:
        raise DataError(f"dataset '{ds.path}' holds token id {largest}, outside its tokenizer's vocabulary of "
                        f"{ds.vocab_size}: the shards do not belong to its tokenizer.json; prepare the dataset again")


def build_loaders(cfg: Config, dp_rank: int = 0, dp_size: int = 1,
                  ledger: SkipLedger | None = None) -> tuple[TrainLoader, ValidationLoader]:
    """The train loader and validation loader of data-parallel rank `dp_rank` of `dp_size`.

    `ledger` is the run's skip ledger (shared with the stability code, which may add ranges while
    training); by default it is read from `<run.dir>/skip_ledger.json`.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    d = cfg.data
    sources = _sources(cfg)
    # Under "stamp" the ranks share the hashing: each verifies 1/dp_size of every dataset's shards.
    datasets = [PreparedDataset.open(path, verify_checksums=d.verify_checksums, cache_dir=d.cache_dir,
                                     part=(dp_rank, dp_size)) for path, _ in sources]
    tokenizers = {ds.manifest["tokenizer"].get("sha256") for ds in datasets}
    if len(tokenizers) > 1:
        raise DataError(f"the data.mix sources were tokenized with {len(tokenizers)} different tokenizers "
                        f"({', '.join(str(ds.path) for ds in datasets)}); prepare them all with one tokenizer.json")
    for ds in datasets:
        check_token_ids(ds, cfg.model.vocab_size)
    rows = rows_per_rank(cfg.train, dp_size)
    global_batch = rows * dp_size
    phases = _phases(cfg, [w for _, w in sources])
    doc_positions = cfg.model.doc_masking

    train_readers = [SequenceReader(ds.splits["train"], d.seq_len, doc_positions) for ds in datasets]
    for k, (ds, reader) in enumerate(zip(datasets, train_readers)):
        if reader.num_sequences < 1 and any(weights[k] > 0 for _, weights in phases):
            raise DataError(f"dataset '{ds.path}' is too small: its {ds.splits['train'].num_tokens} training "
                            f"tokens do not make one sequence of data.seq_len={d.seq_len} (+1) tokens")
    total_sequences = sum(r.num_sequences for r in train_readers)
    if total_sequences < global_batch:
        raise DataError(f"the training data holds {total_sequences} sequences of data.seq_len={d.seq_len}, "
                        f"fewer than one global batch of {global_batch} (micro_batch_size "
                        f"{cfg.train.micro_batch_size} x grad_accum {rows // cfg.train.micro_batch_size} x "
                        f"{dp_size} ranks); "
                        "add data or lower the batch size or seq_len")
    train_mixed = _MixedRows(train_readers, MixSchedule(phases, d.seed), datasets, shuffled=True, seed=d.seed)

    ledger = ledger if ledger is not None else SkipLedger.load(RunDir(cfg.run.dir).ledger)
    skips = [ledger, SkipLedger.from_ranges(d.skip_ranges, reason="data.skip_ranges")]
    train = TrainLoader(train_mixed, d.seq_len, rows, dp_rank, dp_size, d.seed,
                        _fingerprint(datasets, phases, d.seq_len), skips)

    val_readers = [SequenceReader(ds.splits["val"], d.seq_len, doc_positions) for ds in datasets]
    val_mixed = _MixedRows(val_readers, MixSchedule(phases[:1], d.seed), datasets, shuffled=False)
    val = ValidationLoader(val_mixed, d.seq_len, rows, dp_rank, dp_size)
    if cfg.eval.every > 0 and val.num_batches(1) == 0:
        raise DataError(f"the validation split{'s' if len(datasets) > 1 else ''} of "
                        f"{', '.join(str(ds.path) for ds in datasets)} cannot fill one global batch of "
                        f"{global_batch} sequences of {d.seq_len} tokens; prepare with a larger "
                        "--val-fraction, or set eval.every=0")
    return train, val
