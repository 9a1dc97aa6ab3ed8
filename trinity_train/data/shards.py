"""The on-disk format of a prepared dataset, and the code that writes and reads it.

A prepared dataset is a directory:

    manifest.json       written last: it exists only when every file it lists is complete
    tokenizer.json      the `tokenizers` tokenizer the ids come from
    train/00000.bin     token ids, flat, native uint16 (vocabulary <= 65536) or uint32: np.memmap-able
    train/00000.idx     int64 document offsets into that .bin: [0, end of doc 0, end of doc 1, ...]
    train/00000.json    the shard's record (counts, sizes, sha256, build key): the shard is finished
    val/...             the held-out validation split, same layout

A shard's number (its `index`, and its file name) is `task * TASK_SHARDS + n` for the n-th shard
that preparation task `task` wrote (task 0: 00000, 00001, ...; task 3: 300000, ...), so names and
the manifest's order follow from the data alone, whatever ran the tasks. A shard holds at most
`shard_tokens` tokens (a longer document alone). Every document ends with the EOS token and lies
wholly inside one shard, so shard edges are document edges. A shard imported from another tool's
corpus (`import_data.py`) is a hard link to (or, across filesystems, a symlink to) that tool's
token file, never a copy; its record's `token_range` [start, end) says which tokens of the file
are the shard's (the rest belong to the other split), and its .idx offsets count from `start`.

Data files are written under temporary names and renamed; the record is written after them, and
the manifest after all records, so an interrupted build leaves nothing that looks complete but
is not.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from trinity_train.files import atomic_write_json, read_json_object, temp_sibling
from trinity_train.errors import DataError

FORMAT_NAME = "trinity-train-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
OFFSET_DTYPE = np.dtype("<i8")
_HASH_CHUNK = 1 << 24
OPEN_SHARDS = 64  # memory maps a split keeps open (each holds one file descriptor)
TASK_SHARDS = 100_000  # shard numbers per preparation task: task t writes t * TASK_SHARDS + 0, 1, ...


def token_dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _hash_pass(path: str | Path, dtype: np.dtype | None) -> tuple[str, int]:
    h = hashlib.sha256()
    largest = -1
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            if dtype is not None:
                largest = max(largest, int(np.frombuffer(chunk, dtype=dtype).max()))
    return h.hexdigest(), largest


def file_sha256(path: str | Path) -> str:
    return _hash_pass(path, None)[0]


def sha256_and_largest_id(path: str | Path, dtype: np.dtype) -> tuple[str, int]:
    """A token file's sha256 and its largest id (-1 when empty), in one read (measured on the
    default corpus: +1 ms over the 30 ms of hashing alone, benchmarks/README.md)."""
    return _hash_pass(path, dtype)


def shard_index(task: int, number: int) -> int:
    """The index (and file name) of the `number`-th shard preparation task `task` writes."""
    if number >= TASK_SHARDS:
        raise DataError(f"task {task} would write more than {TASK_SHARDS:,} shards; use more --tasks "
                        "or a larger --shard-tokens")
    return task * TASK_SHARDS + number


def shard_names(index: int) -> tuple[str, str, str]:
    """The file names of shard `index`: tokens, offsets, record (strings: a manifest of 10^4-10^5
    shards is checked at every start, and pathlib would cost seconds of it)."""
    stem = f"{index:05d}"
    return f"{stem}.bin", f"{stem}.idx", f"{stem}.json"


def shard_paths(split_dir: Path, index: int) -> tuple[Path, Path, Path]:
    return tuple(split_dir / name for name in shard_names(index))


# ---------------------------------------------------------------------------- writing


class ShardWriter:
    """Streams documents into one shard; `finish()` makes it visible, leaving the context aborts."""

    def __init__(self, split_dir: Path, index: int, dtype: np.dtype, build_key: str):
        split_dir.mkdir(parents=True, exist_ok=True)
        self.index = index
        self.dtype = np.dtype(dtype)
        self.build_key = build_key
        self._bin, self._idx, self._record = shard_paths(split_dir, index)
        self._tmp_bin, self._tmp_idx = temp_sibling(self._bin), temp_sibling(self._idx)
        self._bin_file = open(self._tmp_bin, "wb")
        self._bin_hash = hashlib.sha256()
        self._doc_ends: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_documents = 0
        self.max_token_id = -1  # the largest id written (-1: none yet)

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append documents given as their concatenated ids and their lengths (each > 0)."""
        ids = np.ascontiguousarray(tokens, dtype=self.dtype)
        if len(ids):
            self.max_token_id = max(self.max_token_id, int(ids.max()))
        data = ids.tobytes()
        self._bin_file.write(data)
        self._bin_hash.update(data)
        self._doc_ends.append(self.num_tokens + np.cumsum(doc_lengths, dtype=np.int64))
        self.num_tokens += int(len(tokens))
        self.num_documents += int(len(doc_lengths))

    def finish(self) -> dict:
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())
        self._bin_file.close()
        offsets = np.concatenate([np.zeros(1, np.int64), *self._doc_ends]).astype(OFFSET_DTYPE)
        offsets_bytes = offsets.tobytes()
        self._tmp_idx.write_bytes(offsets_bytes)
        os.replace(self._tmp_bin, self._bin)
        os.replace(self._tmp_idx, self._idx)
        return write_shard_record(self._record, shard_record(
            self.index, self.build_key, self.num_tokens, self.num_documents, self.max_token_id,
            tokens={"bytes": self.num_tokens * self.dtype.itemsize, "sha256": self._bin_hash.hexdigest()},
            offsets={"bytes": len(offsets_bytes), "sha256": hashlib.sha256(offsets_bytes).hexdigest()}))

    def __enter__(self) -> "ShardWriter":
        return self

    def abort(self) -> None:
        """Leave nothing behind: the temporary files go, no record is written."""
        self._bin_file.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def shard_record(index: int, build_key: str, num_tokens: int, num_documents: int, max_token_id: int,
                 tokens: dict, offsets: dict, token_range: tuple[int, int] | None = None) -> dict:
    """A shard's record; `tokens` and `offsets` are its files' {"bytes", "sha256"}. `token_range`:
    the tokens of a shared token file that are this shard's (an imported corpus), else all of it."""
    tokens_name, offsets_name, _ = shard_names(index)
    record = {"index": index, "build_key": build_key, "num_tokens": num_tokens, "num_documents": num_documents,
              "max_token_id": max_token_id, "files": {tokens_name: tokens, offsets_name: offsets}}
    if token_range is not None:
        record["token_range"] = [int(token_range[0]), int(token_range[1])]
    return record


def write_shard_record(path: Path, record: dict) -> dict:
    """Write a shard's record (after its data files: the record says the shard is finished)."""
    atomic_write_json(path, record)
    return record


class TokenSizedShards:
    """One task's shards of one split: documents in order, a new shard whenever the next document
    would take the open one past `shard_tokens` (a document longer than that gets a shard alone).
    The cut depends only on the documents' lengths, never on how they were batched."""

    def __init__(self, split_dir: Path, task: int, dtype: np.dtype, build_key: str, shard_tokens: int,
                 on_finished=None):
        self.split_dir, self.task, self.dtype = split_dir, task, dtype
        self.build_key, self.shard_tokens = build_key, shard_tokens
        self.on_finished = on_finished  # called with each finished shard's record
        self.records: list[dict] = []
        self._writer: ShardWriter | None = None

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Documents as their concatenated ids and their lengths (each > 0)."""
        first_doc = first_token = 0
        while first_doc < len(doc_lengths):
            if self._writer is None:
                self._writer = ShardWriter(self.split_dir, shard_index(self.task, len(self.records)),
                                           self.dtype, self.build_key)
            ends = np.cumsum(doc_lengths[first_doc:], dtype=np.int64)
            fitting = int(np.searchsorted(ends, self.shard_tokens - self._writer.num_tokens, side="right"))
            if fitting == 0 and self._writer.num_tokens == 0:
                fitting = 1  # a document longer than a shard: a shard of its own
            if fitting:
                taken = int(ends[fitting - 1])
                self._writer.add(tokens[first_token:first_token + taken], doc_lengths[first_doc:first_doc + fitting])
                first_doc, first_token = first_doc + fitting, first_token + taken
            if first_doc < len(doc_lengths):  # the next document does not fit: this shard is full
                self._close()

    def _close(self) -> None:
        record = self._writer.finish()
        self._writer = None
        self.records.append(record)
        if self.on_finished is not None:
            self.on_finished(record)

    def finish(self) -> list[dict]:
        """Every shard's record, the open one finished first."""
        if self._writer is not None:
            self._close()
        return self.records

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def split_summary(shard_records: list[dict]) -> dict:
    """A split's manifest entry: its totals and its shards' records."""
    return {"num_tokens": sum(s["num_tokens"] for s in shard_records),
            "num_documents": sum(s["num_documents"] for s in shard_records), "shards": shard_records}


def new_manifest(build_key: str, tokenizer: dict, dtype: np.dtype, splits: dict, **details) -> dict:
    """`tokenizer`: file, sha256, vocab_size, eos_token, eos_id. `details`: what made the data."""
    missing = {"vocab_size", "eos_id"} - set(tokenizer)
    if missing or set(splits) != set(SPLITS):
        raise ValueError(f"a manifest needs tokenizer {sorted(missing)} and splits {SPLITS}")
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "build_key": build_key,
            "tokenizer": tokenizer, "dtype": np.dtype(dtype).str, "splits": splits, **details}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic_write_json(out_dir / MANIFEST, manifest)


# ---------------------------------------------------------------------------- reading


def read_manifest(path: Path) -> dict:
    """The manifest of the prepared dataset at `path`, checked to be one this version can read:
    every key the loader uses, of the right type, and sizes that agree with each other."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        what = "is a file, not a prepared dataset directory" if path.exists() else "does not exist"
        raise DataError(f"dataset directory '{path}' {what}; create one with "
                        f"`trinity-train prepare-data --input ... --out {path}` and pass that directory")
    if not manifest_path.is_file():
        raise DataError(f"'{path}' is not a complete prepared dataset (no {MANIFEST}); "
                        "run `trinity-train prepare-data` to finish it")
    try:
        manifest = read_json_object(manifest_path, DataError)
    except DataError as e:
        raise DataError(f"{e}; prepare the dataset again") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"'{manifest_path}' is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest; "
                        "prepare the dataset again with this version of trinity-train")
    problem = manifest_problem(manifest)
    if problem:
        raise DataError(f"'{manifest_path}' is damaged: {problem}; prepare the dataset again")
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_problem(manifest: dict) -> str | None:
    """What makes `manifest` unusable (a missing or mistyped key, sizes that disagree), or None."""
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict):
        return "it has no 'tokenizer' object"
    for key in ("vocab_size", "eos_id"):
        if not _is_count(tokenizer.get(key)):
            return f"'tokenizer.{key}' must be a count, got {tokenizer.get(key)!r}"
    try:
        dtype = np.dtype(manifest.get("dtype"))
    except TypeError:
        dtype = None
    if dtype not in (np.dtype("<u2"), np.dtype("<u4")):
        return f"'dtype' must be '<u2' or '<u4', got {manifest.get('dtype')!r}"
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or set(splits) < set(SPLITS):
        return f"'splits' must hold {' and '.join(SPLITS)}"
    for split in SPLITS:
        problem = _split_problem(splits[split], split, dtype)
        if problem:
            return problem
    return None


def _split_problem(info, split: str, dtype: np.dtype) -> str | None:
    if not isinstance(info, dict) or not isinstance(info.get("shards"), list):
        return f"split '{split}' has no list of 'shards'"
    for shard in info["shards"]:
        where = f"shard {shard.get('index')!r} of split '{split}'" if isinstance(shard, dict) else f"split '{split}'"
        if not isinstance(shard, dict) or not all(_is_count(shard.get(k)) for k in ("index", "num_tokens",
                                                                                    "num_documents")):
            return f"{where} lacks its index, num_tokens or num_documents"
        tokens, offsets, _ = shard_names(shard["index"])
        files = shard.get("files")
        if not isinstance(files, dict) or not all(isinstance(files.get(n), dict) and _is_count(files[n].get("bytes"))
                                                  and isinstance(files[n].get("sha256"), str) for n in (tokens, offsets)):
            return f"{where} does not list {tokens} and {offsets} with their bytes and sha256"
        problem = _token_range_problem(shard, files[tokens]["bytes"] // dtype.itemsize)
        if problem:
            return f"{where} {problem}"
        if "token_range" not in shard and files[tokens]["bytes"] != shard["num_tokens"] * dtype.itemsize:
            return (f"{where} claims {shard['num_tokens']} tokens but its {tokens} holds "
                    f"{files[tokens]['bytes'] // dtype.itemsize}")
        if files[offsets]["bytes"] != (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize:
            return f"{where} claims {shard['num_documents']} documents but its {offsets} holds another number"
    total = sum(s["num_tokens"] for s in info["shards"])
    if info.get("num_tokens") != total:
        return f"split '{split}' claims {info.get('num_tokens')!r} tokens but its shards hold {total}"
    return None


def _token_range_problem(shard: dict, file_tokens: int) -> str | None:
    if "token_range" not in shard:
        return None
    span = shard["token_range"]
    if not (isinstance(span, list) and len(span) == 2 and all(_is_count(v) for v in span)
            and span[1] - span[0] == shard["num_tokens"] and span[1] <= file_tokens):
        return (f"has a token_range {span!r} that is not [start, start + num_tokens] inside its "
                f"{file_tokens}-token file")
    return None


def token_start(shard: dict) -> int:
    """Where a shard's tokens begin in its token file (0 unless it shares the file)."""
    return shard["token_range"][0] if "token_range" in shard else 0


def manifest_fingerprint(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class _Shard:
    tokens_path: str
    offsets_path: str
    num_tokens: int
    num_documents: int
    index: int = 0  # the shard's number in the manifest (its file name)
    token_start: int = 0  # where its tokens begin in the token file (a shared, imported file)


class _OpenMaps:
    """The most recently read shard files, memory-mapped: a bounded number stays open, so a split
    of 10^5 shards read in random order neither runs out of file descriptors nor keeps every
    mapping (a closed map's pages stay only as long as an array read from it)."""

    def __init__(self, limit: int = OPEN_SHARDS):
        self.limit, self._maps = limit, OrderedDict()

    def get(self, path: str, dtype: np.dtype, start: int = 0, count: int | None = None) -> np.ndarray:
        """Elements [start, start + count) of the file (all of it by default): an imported
        corpus's splits share one token file."""
        key = (path, start)
        if key in self._maps:
            self._maps.move_to_end(key)
        else:
            self._maps[key] = np.memmap(path, dtype=dtype, mode="r", offset=start * np.dtype(dtype).itemsize,
                                        shape=None if count is None else (count,))
            if len(self._maps) > self.limit:
                self._maps.popitem(last=False)
        return self._maps[key]


class TokenSplit:
    """One split of a prepared dataset, read as one long token array cut into documents."""

    def __init__(self, dtype: np.dtype, shards: list[_Shard]):
        self.dtype = dtype
        self._shards = [s for s in shards if s.num_tokens > 0]
        sizes = [s.num_tokens for s in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_tokens = int(self._starts[-1])
        self.num_documents = sum(s.num_documents for s in self._shards)
        self._tokens = _OpenMaps()
        self._offsets = _OpenMaps()

    def _shard_tokens(self, i: int) -> np.ndarray:
        shard = self._shards[i]
        return self._tokens.get(shard.tokens_path, self.dtype, shard.token_start, shard.num_tokens)

    def _shard_offsets(self, i: int) -> np.ndarray:
        return self._offsets.get(self._shards[i].offsets_path, OFFSET_DTYPE)

    def _shards_overlapping(self, start: int, end: int) -> range:
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, end, side="left")) - 1
        return range(first, last + 1)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length), across shard edges."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        parts = []
        for i in self._shards_overlapping(start, start + length):
            base = int(self._starts[i])
            lo, hi = max(start - base, 0), min(start + length - base, self._shards[i].num_tokens)
            parts.append(self._shard_tokens(i)[lo:hi])
        return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])

    def locate(self, offset: int) -> tuple[int, int, int]:
        """(shard number, document number within the shard, token offset within that document)
        of the token at global `offset`: where a row of a batch came from."""
        i = int(np.searchsorted(self._starts, offset, side="right")) - 1
        local = offset - int(self._starts[i])
        offsets = self._shard_offsets(i)
        document = int(np.searchsorted(offsets, local, side="right")) - 1
        return self._shards[i].index, document, local - int(offsets[document])

    def document_starts(self, start: int, end: int) -> np.ndarray:
        """Global start offsets of the documents overlapping [start, end), first one <= start."""
        parts = []
        for i in self._shards_overlapping(start, end):
            base = int(self._starts[i])
            offsets = self._shard_offsets(i)
            lo = int(np.searchsorted(offsets, max(start - base, 0), side="right")) - 1
            # offsets[-1] is the shard's end, not a document start
            hi = min(int(np.searchsorted(offsets, end - base, side="left")), len(offsets) - 1)
            parts.append(np.asarray(offsets[lo:hi]) + base)
        return np.concatenate(parts)


class PreparedDataset:
    """A prepared dataset directory, checked against its manifest."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.fingerprint = manifest_fingerprint(manifest)
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self.eos_id: int = manifest["tokenizer"]["eos_id"]
        self.dtype = np.dtype(manifest["dtype"])
        self.max_token_id: int | None = None  # the largest token id in the shards, once verified

    @classmethod
    def open(cls, path: str | Path, verify_checksums: str | bool = "stamp", cache_dir: str | Path | None = None,
             part: tuple[int, int] = (0, 1)) -> "PreparedDataset":
        """Open and verify the dataset (`verify` says how); `cache_dir` holds the verification
        stamps and the largest token id of a dataset whose manifest does not record it."""
        path = Path(path).expanduser()
        dataset = cls(path, read_manifest(path))
        dataset.verify(checksums=verify_checksums, cache_dir=cache_dir, part=part)
        return dataset

    def _shards(self):
        """(split, record, [(file path as a string, its record)]) of every shard, in manifest order."""
        for split in SPLITS:
            split_dir = os.path.join(self.path, split)
            for shard in self.manifest["splits"][split]["shards"]:
                yield split, shard, [(f"{split_dir}/{name}", info) for name, info in shard["files"].items()]

    def verify(self, checksums: str | bool = "stamp", cache_dir: str | Path | None = None,
               part: tuple[int, int] = (0, 1)) -> None:
        """Every listed file exists with its recorded size, always (one stat per file), then by
        `checksums` (`data.verify_checksums`; True is "full", False "sizes"):

        - "full": every shard's sha256 against the manifest, at every start;
        - "stamp": process `part` = (p, P) of P hashes the shards whose number (in manifest order,
          train then val) is p modulo P, once: each leaves a stamp in `cache_dir` (its files'
          sizes, mtimes and inodes), and a later start hashes only an own shard whose files no
          longer match their stamp. The P ranks of a job together hash every shard once, each
          1/P of it; a rank that finds a damaged shard fails the job before its first step (a
          step needs every rank). Without a `cache_dir`, the own shards at every start;
        - "sizes": no hashing (the loader still checks each batch's ids against the vocabulary).

        Sets `max_token_id` (the hashed shards' largest, and the manifest's record of the others;
        unrecorded ones are read once, cached in `cache_dir`)."""
        mode = {True: "full", False: "sizes"}.get(checksums, checksums)
        if mode not in ("full", "stamp", "sizes"):
            raise ValueError(f"unknown verification {checksums!r}")
        rank, ranks = part if mode == "stamp" else (0, 1)
        stamps = self._stamp_dir(cache_dir) if mode == "stamp" and cache_dir else None
        largest, unrecorded = -1, []
        for number, (split, shard, files) in enumerate(self._shards()):
            identity = [self._checked_size(path, info) for path, info in files]
            if mode != "sizes" and number % ranks == rank:
                largest = max(largest, self._verified(split, shard, files, identity, stamps))
            elif _is_count(shard.get("max_token_id")):
                largest = max(largest, shard["max_token_id"])
            else:
                unrecorded += [Path(path) for path, _ in files if path.endswith(".bin")]
        if unrecorded:
            largest = max(largest, _cached_largest_id(unrecorded, self.dtype, self.fingerprint, cache_dir))
        self.max_token_id = largest

    def _stamp_dir(self, cache_dir: str | Path) -> Path:
        where = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return Path(cache_dir).expanduser() / "verified" / f"{self.fingerprint}-{where}"

    def _checked_size(self, path: str, info: dict) -> list:
        """The file's identity for a stamp (size, mtime, inode), once its size is checked."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise DataError(f"dataset '{self.path}' is missing '{path}'; prepare it again") from None
        if st.st_size != info["bytes"]:
            raise DataError(f"'{path}' has {st.st_size} bytes but the manifest says "
                            f"{info['bytes']}: the dataset changed or is damaged; prepare it again")
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def _verified(self, split: str, shard: dict, files: list, identity: list, stamps: Path | None) -> int:
        """The largest token id of a shard whose files hash to their records: from its stamp when
        the files are the ones stamped, else hashed now (and stamped when `stamps` is given)."""
        stamp = stamps / f"{split}-{shard['index']}.json" if stamps else None
        if stamp is not None:
            try:
                recorded = read_json_object(stamp, DataError)
                if recorded.get("files") == identity and isinstance(recorded.get("max_token_id"), int):
                    return recorded["max_token_id"]
            except DataError:
                pass
        largest = -1
        for path, info in files:
            digest, found = (sha256_and_largest_id(path, self.dtype) if path.endswith(".bin")
                             else (file_sha256(path), -1))
            if digest != info["sha256"]:
                raise DataError(f"'{path}' does not match its manifest checksum: the dataset changed "
                                "or is damaged; prepare it again")
            largest = max(largest, found)
        if stamp is not None:
            _keep_in_cache(stamp, {"files": identity, "max_token_id": largest})
        return largest

    @cached_property
    def splits(self) -> dict[str, TokenSplit]:
        out = {}
        for split in SPLITS:
            shards, split_dir = [], os.path.join(self.path, split)
            for s in self.manifest["splits"][split]["shards"]:
                bin_path, idx_path, _ = (f"{split_dir}/{name}" for name in shard_names(s["index"]))
                shards.append(_Shard(bin_path, idx_path, s["num_tokens"], s["num_documents"], s["index"],
                                     token_start(s)))
            out[split] = TokenSplit(self.dtype, shards)
        return out


def _largest_id(paths: list[Path], dtype: np.dtype) -> int:
    largest = -1
    for path in paths:
        ids = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.empty(0, dtype)
        if len(ids):
            largest = max(largest, int(ids.max()))
    return largest


def _cached_largest_id(paths: list[Path], dtype: np.dtype, fingerprint: str, cache_dir: str | Path | None) -> int:
    """The largest id in `paths`, read once per dataset and set of files (sizes and mtimes)."""
    identity = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]
    cache = Path(cache_dir).expanduser() / "token-ranges" / f"{fingerprint}.json" if cache_dir else None
    if cache is not None:
        try:
            cached = read_json_object(cache, DataError)
            if cached.get("files") == identity:
                return int(cached["max_token_id"])
        except (DataError, ValueError, KeyError, TypeError):
            pass
    largest = _largest_id(paths, dtype)
    if cache is not None:
        _keep_in_cache(cache, {"files": identity, "max_token_id": largest})
    return largest


def _keep_in_cache(path: Path, record: dict) -> None:
    try:
        atomic_write_json(path, record)
    except OSError:
        pass  # a read-only cache only costs the next start the work again
