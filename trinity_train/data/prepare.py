"""`trinity-train prepare-data`: raw documents -> packed token shards + manifest.

Documents are read with `datasets`, split into train and a held-out validation set (a seeded
choice of whole documents), tokenized in batches by a `tokenizers` tokenizer in `num_proc`
worker processes, each followed by the EOS token, and packed into shards (see `shards.py`).

A build is identified by its *build key* (the input files' paths, sizes and modification times,
the tokenizer, and every option that changes the output). A rerun with the same key reuses the
shards (and trained tokenizer) a previous, possibly interrupted, run finished; the manifest is
written last, so a directory without one is never mistaken for a complete dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
from filelock import FileLock
from tokenizers import Tokenizer
from tqdm import tqdm

from trinity_train import __version__
from trinity_train.files import atomic_write_json, atomic_write_text, output_directory, read_json_object
from trinity_train.data.documents import FORMATS, TEXT, Inputs, load_documents, resolve_inputs
from trinity_train.data.shards import (FORMAT_VERSION, MANIFEST, SPLITS, TOKENIZER_FILE, ShardWriter,
                                       file_sha256, finished_shard, new_manifest, read_manifest,
                                       shard_paths, split_summary, token_dtype_for, write_manifest)
from trinity_train.data.tokenizer import (MIN_BPE_VOCAB, find_eos_id, load_tokenizer, tokenizer_sha256,
                                          train_byte_level_bpe, vocab_size_of)
from trinity_train.errors import ArgumentError, ConfigError, DataError

_TRAINED_TOKENIZER_RECORD = "tokenizer.build.json"  # which build trained tokenizer.json
_LOCK = ".prepare.lock"
_WORK_PREFIX = ".work-"
_ENCODE_BATCH = 512
_WRITE_BATCH = 8192


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: str
    tokenizer: str = ""  # a tokenizer.json to use as is ...
    train_tokenizer: int = 0  # ... or the vocabulary size of a byte-level BPE to train on the input
    eos_token: str = ""  # "" finds the usual names (<|endoftext|>, </s>, ...)
    text_field: str = "text"
    format: str = "auto"  # or one of documents.FORMATS, for every input
    sample_by: str = "document"  # text files: one document per "document" (file), "paragraph" or "line"
    encoding_errors: str = "strict"  # or "replace"/"ignore" for undecodable bytes
    skip_bad_records: bool = False
    val_fraction: float = 0.02
    seed: int = 0  # chooses the validation documents
    dtype: str = "auto"  # token file dtype: "auto" (uint16 if the vocabulary fits), "uint16", "uint32"
    shard_documents: int = 65536
    num_proc: int = 1
    overwrite: bool = False  # replace a different dataset already in `out`
    progress: bool = True
    hub_config: str = ""
    hub_split: str = "train"
    stats: dict = field(default_factory=dict)  # filled in: what the run did, for reports


def prepare(opts: PrepareOptions) -> Path:
    """Build (or finish, or confirm) the prepared dataset in `opts.out`; returns its path.

    Runs on the same `out` take turns (a file lock): a second one finds the first one's manifest.
    """
    _check_options(opts)
    started = time.perf_counter()
    out = output_directory(opts.out, "--out")
    inputs = resolve_inputs(opts.inputs, opts.format, opts.hub_config, opts.hub_split)
    tokenizer_spec = ({"train_vocab": opts.train_tokenizer} if opts.train_tokenizer
                      else {"sha256": file_sha256(_existing(opts.tokenizer))})
    build_key = _build_key(opts, inputs.fingerprint(), tokenizer_spec)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _prepare_locked(opts, out, inputs, build_key, started)
    except BaseException:
        if created:  # a build that failed before writing anything leaves no directory behind
            _remove_if_only_the_lock(out)
        raise
    return out


def _remove_if_only_the_lock(out: Path) -> None:
    if [p.name for p in out.iterdir()] == [_LOCK]:
        (out / _LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            out.rmdir()


def _prepare_locked(opts: PrepareOptions, out: Path, inputs: Inputs, build_key: str, started: float) -> None:
    with FileLock(str(out / _LOCK)):
        if (out / MANIFEST).is_file():
            previous = read_manifest(out)
            if previous.get("build_key") == build_key:
                opts.stats.update(reused=True, seconds=time.perf_counter() - started)
                return
            if not opts.overwrite:
                raise ArgumentError(f"--out '{out}' already holds a different prepared dataset; choose another "
                                    "--out or pass --overwrite to replace it")
            (out / MANIFEST).unlink()  # from here on the directory no longer looks complete
        for stale in out.glob(f"{_WORK_PREFIX}*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=_WORK_PREFIX, dir=out))  # datasets' cache; never reused
        try:
            _build(opts, out, inputs, build_key, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    opts.stats["seconds"] = time.perf_counter() - started


def _build(opts: PrepareOptions, out: Path, inputs: Inputs, build_key: str, work: Path) -> None:
    docs, report = load_documents(inputs, opts.text_field, work, opts.num_proc,
                                  opts.skip_bad_records, opts.sample_by, opts.encoding_errors)
    split_docs = split_validation(docs, opts.val_fraction, opts.seed)
    tokenizer = _tokenizer(opts, out, build_key, split_docs["train"])
    eos_token, eos_id = find_eos_id(tokenizer, opts.eos_token or None)
    vocab_size = vocab_size_of(tokenizer)
    dtype = _token_dtype(opts.dtype, vocab_size)
    encoder = DocumentEncoder(tokenizer.to_str(), eos_id)
    with tqdm(total=len(docs), unit="doc", desc=f"prepare {out.name}", disable=not opts.progress,
              file=sys.stderr) as bar:
        splits = {name: _write_split(split_docs[name], out / name, name, encoder, dtype, build_key,
                                     opts, bar) for name in SPLITS}
    if splits["train"]["num_tokens"] == 0:
        raise DataError("the input holds no text: every document is empty")
    _remove_stale_files(out, splits)
    write_manifest(out, new_manifest(
        build_key,
        tokenizer={"file": TOKENIZER_FILE, "sha256": tokenizer_sha256(tokenizer),
                   "vocab_size": vocab_size, "eos_token": eos_token, "eos_id": eos_id},
        dtype=dtype, splits=splits,
        created_by=f"trinity-train {__version__}",
        inputs={"files": [str(p) for p, _ in inputs.files], "hub": inputs.hub_name,
                "bytes": inputs.total_bytes(), "text_field": opts.text_field},
        val_fraction=opts.val_fraction, seed=opts.seed, bad_records_skipped=report.bad_records))
    opts.stats.update(reused=False, input_bytes=inputs.total_bytes(),
                      train_tokens=splits["train"]["num_tokens"], val_tokens=splits["val"]["num_tokens"],
                      documents=sum(s["num_documents"] for s in splits.values()),
                      bad_records=report.bad_records, bad_examples=report.bad_examples)


def _check_options(opts: PrepareOptions) -> None:
    """Option values no input can make right are usage mistakes (ConfigError: exit 2)."""
    if opts.train_tokenizer and opts.train_tokenizer < MIN_BPE_VOCAB or opts.train_tokenizer < 0:
        raise _vocabulary_too_small(opts.train_tokenizer)
    if bool(opts.tokenizer) == bool(opts.train_tokenizer):
        raise ConfigError("give exactly one of --tokenizer PATH and --train-tokenizer VOCAB")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {opts.val_fraction}")
    if opts.num_proc < 1 or opts.shard_documents < 1:
        raise ConfigError("--num-proc and --shard-documents must be positive")
    for name, value, allowed in (("--format", opts.format, ("auto", *FORMATS)),
                                 ("--dtype", opts.dtype, ("auto", "uint16", "uint32")),
                                 ("--sample-by", opts.sample_by, ("document", "paragraph", "line")),
                                 ("--encoding-errors", opts.encoding_errors, ("strict", "replace", "ignore"))):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got '{value}'")


def _vocabulary_too_small(vocab: int) -> ConfigError:
    return ConfigError(f"--train-tokenizer must be a vocabulary size of at least {MIN_BPE_VOCAB}, got {vocab} "
                       "(a byte-level BPE holds every byte plus the end-of-document and padding tokens)")


def _existing(path: str) -> Path:
    load_tokenizer(path)  # the one clear message for a missing or unreadable tokenizer
    return Path(path).expanduser()


def _build_key(opts: PrepareOptions, input_fingerprint: list, tokenizer_spec: dict) -> str:
    options = asdict(opts)
    for irrelevant in ("inputs", "out", "tokenizer", "num_proc", "overwrite", "progress", "stats"):
        options.pop(irrelevant)
    payload = {"format_version": FORMAT_VERSION, "inputs": input_fingerprint,
               "tokenizer": tokenizer_spec, "options": options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def split_validation(docs: datasets.Dataset, val_fraction: float, seed: int) -> dict[str, datasets.Dataset]:
    """Hold out a seeded random choice of whole documents; both splits keep the input order."""
    n = len(docs)
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    if n - n_val < 1:
        raise DataError(f"the input holds only {n} document(s): too few to hold out a validation "
                        f"split of {val_fraction}; add documents or lower --val-fraction")
    val_idx = np.sort(np.random.default_rng(seed).choice(n, n_val, replace=False))
    keep = np.ones(n, dtype=bool)
    keep[val_idx] = False
    return {"train": docs.select(np.flatnonzero(keep)), "val": docs.select(val_idx)}


def _tokenizer(opts: PrepareOptions, out: Path, build_key: str, train_docs: datasets.Dataset) -> Tokenizer:
    path = out / TOKENIZER_FILE
    if not opts.train_tokenizer:
        tokenizer = load_tokenizer(opts.tokenizer)
    else:
        record_path = out / _TRAINED_TOKENIZER_RECORD
        try:
            record = read_json_object(record_path, DataError)
            if record["build_key"] == build_key and file_sha256(path) == record["sha256"]:
                return load_tokenizer(path)  # trained by an earlier run of this same build
        except (DataError, OSError, KeyError):
            pass
        batches = (batch[TEXT] for batch in train_docs.iter(batch_size=_WRITE_BATCH))
        tokenizer = train_byte_level_bpe(batches, opts.train_tokenizer, len(train_docs))
    atomic_write_text(path, tokenizer.to_str())
    if opts.train_tokenizer:
        atomic_write_json(out / _TRAINED_TOKENIZER_RECORD, {"build_key": build_key, "sha256": file_sha256(path)})
    return tokenizer


def _token_dtype(requested: str, vocab_size: int) -> np.dtype:
    fitting = token_dtype_for(vocab_size)
    if requested == "auto":
        return fitting
    dtype = np.dtype("<u2" if requested == "uint16" else "<u4")
    if dtype.itemsize < fitting.itemsize:
        raise DataError(f"the tokenizer's vocabulary of {vocab_size} does not fit in {requested} "
                        f"(at most {1 << 16} ids); use --dtype uint32 or auto")
    return dtype


class DocumentEncoder:
    """The `datasets.map` function: texts -> token ids + EOS. Picklable for worker processes."""

    def __init__(self, tokenizer_json: str, eos_id: int):
        self.tokenizer_json = tokenizer_json
        self.eos_id = eos_id
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict:
        return {"tokenizer_json": self.tokenizer_json, "eos_id": self.eos_id, "_tokenizer": None}

    def __call__(self, texts: list[str]) -> dict:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
        encodings = self._tokenizer.encode_batch(texts)
        # An empty document becomes no tokens at all (not a lone EOS); the writer drops it.
        return {"ids": [e.ids + [self.eos_id] if text else [] for e, text in zip(encodings, texts)]}


_IDS_FEATURES = datasets.Features({"ids": datasets.List(datasets.Value("uint32"))})


def _write_split(docs: datasets.Dataset, split_dir: Path, split: str, encoder: DocumentEncoder,
                 dtype: np.dtype, build_key: str, opts: PrepareOptions, bar: tqdm) -> dict:
    shards = []
    for index, start in enumerate(range(0, len(docs), opts.shard_documents)):
        end = min(start + opts.shard_documents, len(docs))
        record = finished_shard(split_dir, index, build_key)
        if record is None:
            record = _write_shard(docs.select(range(start, end)), split_dir, index, encoder, dtype,
                                  f"{build_key[:16]}-{split}-{index}", build_key, opts.num_proc)
        shards.append(record)
        bar.update(end - start)
        bar.set_postfix_str(f"{sum(s['num_tokens'] for s in shards):,} {split} tokens")
    return split_summary(shards)


def _write_shard(docs: datasets.Dataset, split_dir: Path, index: int, encoder: DocumentEncoder,
                 dtype: np.dtype, fingerprint: str, build_key: str, num_proc: int) -> dict:
    procs = min(num_proc, -(-len(docs) // _ENCODE_BATCH))
    if procs > 1:  # each worker encodes on one thread; avoids tokenizers' fork warning
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenized = docs.map(encoder, batched=True, batch_size=_ENCODE_BATCH, input_columns=[TEXT],
                         remove_columns=[TEXT], features=_IDS_FEATURES, keep_in_memory=True,
                         num_proc=procs if procs > 1 else None, new_fingerprint=fingerprint)
    with ShardWriter(split_dir, index, dtype, build_key) as writer:
        for table in tokenized.with_format("arrow").iter(batch_size=_WRITE_BATCH):
            ids = table.column("ids").combine_chunks()
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            writer.add(pc.list_flatten(ids).to_numpy(), lengths[lengths > 0])
        return writer.finish()


def _remove_stale_files(out: Path, splits: dict) -> None:
    """Shards of an earlier, different build that this one did not overwrite."""
    for split, info in splits.items():
        keep = {p.name for s in info["shards"] for p in shard_paths(out / split, s["index"])}
        for path in (out / split).iterdir():
            if path.name not in keep:
                path.unlink()


# ---------------------------------------------------------------------------- command line


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    d = PrepareOptions(inputs=[], out="")
    parser.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH",
                        help="a file, glob or directory of jsonl/json/parquet/txt/csv (repeatable), "
                             "or hub:NAME for a Hugging Face hub dataset")
    parser.add_argument("--out", required=True, metavar="DIR", help="the prepared dataset directory")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="PATH", help="a tokenizers tokenizer.json")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                     help="train a byte-level BPE of this vocabulary size on the training documents")
    parser.add_argument("--eos-token", default=d.eos_token, help="end-of-document token (default: found)")
    parser.add_argument("--text-field", default=d.text_field, help="field/column holding the text")
    parser.add_argument("--format", default=d.format, choices=("auto", *FORMATS),
                        help="input format (default: from each file's extension)")
    parser.add_argument("--sample-by", default=d.sample_by, choices=("document", "paragraph", "line"),
                        help="what one document is in a txt file")
    parser.add_argument("--encoding-errors", default=d.encoding_errors, choices=("strict", "replace", "ignore"))
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="count and skip malformed records instead of stopping at the first")
    parser.add_argument("--val-fraction", type=float, default=d.val_fraction,
                        help="fraction of documents held out for validation")
    parser.add_argument("--seed", type=int, default=d.seed, help="chooses the validation documents")
    parser.add_argument("--dtype", default=d.dtype, choices=("auto", "uint16", "uint32"),
                        help="token file dtype (auto: uint16 when the vocabulary fits)")
    parser.add_argument("--shard-documents", type=int, default=d.shard_documents,
                        help="documents per shard")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1,
                        help="worker processes for reading and tokenizing")
    parser.add_argument("--overwrite", action="store_true", help="replace a different dataset in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--hub-config", default=d.hub_config, help="hub dataset configuration name")
    parser.add_argument("--hub-split", default=d.hub_split, help="hub dataset split to read")


def run_prepare(args: argparse.Namespace) -> int:
    """Run `prepare-data` from parsed arguments; a UserError propagates for the CLI to print."""
    if args.train_tokenizer is not None and args.train_tokenizer <= 0:  # 0 would read as "not given"
        raise _vocabulary_too_small(args.train_tokenizer)
    names = set(PrepareOptions.__dataclass_fields__) - {"stats"}
    opts = PrepareOptions(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    out = prepare(opts)
    s = opts.stats
    if s["reused"]:
        print(f"{out}: already prepared from these inputs; nothing to do")
        return 0
    for example in s["bad_examples"]:
        print(f"skipped: {example}", file=sys.stderr)
    mb = s["input_bytes"] / 1e6
    tokens = s["train_tokens"] + s["val_tokens"]
    print(f"{out}: {s['train_tokens']:,} train + {s['val_tokens']:,} val tokens from {s['documents']:,} "
          f"documents ({s['bad_records']} bad records skipped); {mb:.1f} MB in {s['seconds']:.1f} s "
          f"= {mb / s['seconds']:.2f} MB/s, {tokens / s['seconds']:,.0f} tokens/s")
    return 0
