"""`trinity-train prepare-data`: raw documents -> packed token shards + manifest, on datatrove.

Tokenizer training (when no tokenizer is given) runs here, on one machine, on a sample: the
training documents of the first input files, up to `tokenizer_sample_bytes`. Then a datatrove
pipeline (prepare_steps.py) runs `tasks` tasks on the chosen executor (executors.py: local
processes, SLURM array jobs, Ray): each reads its slice of the input files, holds out validation
documents by a seeded hash of their text, tokenizes the rest with the tokenizer (EOS appended) and
writes shards of at most `shard_tokens` tokens and a task record. Last, the manifest is written
from the task records (no data copied).

A build is identified by its *build key* (the input files' paths, sizes and modification times,
the tokenizer, the task count and every other option that changes the output; not the executor
or the worker count, which do not). A rerun with the same key runs only the tasks that did not
finish (datatrove's completion markers) and reuses the trained tokenizer; the manifest is
written last, so a directory without one is never mistaken for a complete dataset.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from filelock import FileLock
from tokenizers import Tokenizer

from trinity_train import __version__
from trinity_train.files import atomic_write_json, atomic_write_text, output_directory, read_json_object
from trinity_train.data.documents import FORMATS, TEXT, Inputs, load_documents, resolve_inputs
from trinity_train.data.executors import (EXECUTORS, ExecutorOptions, TasksUnfinished, check_executor_options,
                                          run_pipeline)
from trinity_train.data.prepare_footprint import Footprint
from trinity_train.data.prepare_steps import (ReadInputs, ReadOptions, ShardOptions, TokenizeToShards,
                                              datatrove_logging, is_validation, read_report_path,
                                              task_record_path)
from trinity_train.data.shards import (FORMAT_VERSION, MANIFEST, SPLITS, TOKENIZER_FILE, file_sha256,
                                       new_manifest, read_manifest, shard_paths, split_summary,
                                       token_dtype_for, write_manifest)
from trinity_train.data.tokenizer import (MIN_BPE_VOCAB, find_eos_id, load_tokenizer, tokenizer_sha256,
                                          train_byte_level_bpe, vocab_size_of)
from trinity_train.errors import ArgumentError, ConfigError, DataError, UserError

_TRAINED_TOKENIZER_RECORD = "tokenizer.build.json"  # which build trained tokenizer.json
_LOCK = ".prepare.lock"
_WORK_PREFIX = ".work-"
_PIPELINE_DIR = ".prepare"  # datatrove's logging directories, one per build key
_OWNED = (_LOCK, _PIPELINE_DIR, f"{_WORK_PREFIX}*", MANIFEST, TOKENIZER_FILE, _TRAINED_TOKENIZER_RECORD, *SPLITS)
_SAMPLE_BATCH = 8192
# 2^30 tokens: 2 GiB of uint16 ids (4 GiB of uint32) a shard, so 15T tokens are ~14,000 shard
# records (not 2x10^5 of 65,536 documents), and one shard is still seconds to hash or copy.
DEFAULT_SHARD_TOKENS = 1 << 30
DEFAULT_TOKENIZER_SAMPLE_BYTES = 1 << 30  # of input files, read in order, to train a BPE on


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: str
    tokenizer: str = ""  # a tokenizer.json to use as is ...
    train_tokenizer: int = 0  # ... or the vocabulary size of a byte-level BPE to train on the input
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES
    eos_token: str = ""  # "" finds the usual names (<|endoftext|>, </s>, ...)
    text_field: str = "text"
    format: str = "auto"  # or one of documents.FORMATS, for every input
    sample_by: str = "document"  # text files: one document per "document" (file), "paragraph" or "line"
    encoding_errors: str = "strict"  # or "replace"/"ignore" for undecodable bytes
    skip_bad_records: bool = False
    val_fraction: float = 0.02
    seed: int = 0  # keys the hash that holds documents out for validation
    dtype: str = "auto"  # token file dtype: "auto" (uint16 if the vocabulary fits), "uint16", "uint32"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    tasks: int = 1  # pipeline tasks; files go to tasks round-robin, so this is part of the token order
    workers: int = 0  # tasks at once (0: local, one per CPU; slurm/ray, no limit); not in the build key
    executor: str = "local"
    slurm_partition: str = ""
    slurm_time: str = "24:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    ray_address: str = ""
    overwrite: bool = False  # replace a different dataset already in `out`
    progress: bool = True
    hub_config: str = ""
    hub_split: str = "train"
    stats: dict = field(default_factory=dict)  # filled in: what the run did, for reports


# Options that choose how (where, how fast) the build runs, not what it makes.
_RUN_OPTIONS = {f.name for f in fields(ExecutorOptions)} - {"tasks"}


def prepare(opts: PrepareOptions) -> Path:
    """Build (or finish, or confirm) the prepared dataset in `opts.out`; returns its path.

    Runs on the same `out` take turns (a file lock): a second one finds the first one's manifest.
    """
    _check_options(opts)
    started = time.perf_counter()
    out = output_directory(opts.out, "--out")
    inputs = resolve_inputs(opts.inputs, opts.format, opts.hub_config, opts.hub_split)
    if inputs.hub_name and opts.tasks > 1:
        raise ConfigError("a hub dataset is one stream that one task reads: pass --tasks 1, or download "
                          "its files and pass them as --input")
    tokenizer_spec = ({"train_vocab": opts.train_tokenizer} if opts.train_tokenizer
                      else {"sha256": file_sha256(_existing(opts.tokenizer))})
    build_key = _build_key(opts, inputs.fingerprint(), tokenizer_spec)
    _refuse_early(opts, out, build_key)
    footprint = Footprint(out, _OWNED, _LOCK)
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / _LOCK)):
        if _reused(opts, out, build_key, started):
            return out
        footprint.snapshot()  # (after the reuse check: a finished dataset's shards need no listing)
        try:
            _prepare_locked(opts, out, inputs, build_key, started)
        except BaseException as e:
            # A refusal takes back what this run wrote; any other failure (Ctrl-C, a task left
            # unfinished, a full disk) keeps it for the rerun, but leaves no empty directory.
            if (isinstance(e, UserError) and not isinstance(e, TasksUnfinished)
                    or footprint.created_dirs and [p.name for p in out.iterdir()] == [_LOCK]):
                footprint.take_back()
            raise
    return out


def _refuse_early(opts: PrepareOptions, out: Path, build_key: str) -> None:
    """The refusals known before anything is written, raised before `out` is touched."""
    if (out / MANIFEST).is_file() and read_manifest(out).get("build_key") != build_key and not opts.overwrite:
        raise _other_dataset(out)
    if opts.tokenizer:
        tokenizer = load_tokenizer(opts.tokenizer)
        find_eos_id(tokenizer, opts.eos_token or None)
        _token_dtype(opts.dtype, vocab_size_of(tokenizer))


def _other_dataset(out: Path) -> ArgumentError:
    return ArgumentError(f"--out '{out}' already holds a different prepared dataset; choose another --out or "
                         "pass --overwrite to replace it")


def _reused(opts: PrepareOptions, out: Path, build_key: str, started: float) -> bool:
    """Whether `out` already holds this build, finished (under the lock: maybe by a run that held
    it since _refuse_early looked)."""
    if (out / MANIFEST).is_file() and read_manifest(out).get("build_key") == build_key:
        opts.stats.update(reused=True, seconds=time.perf_counter() - started)
        return True
    return False


def _prepare_locked(opts: PrepareOptions, out: Path, inputs: Inputs, build_key: str, started: float) -> None:
    if (out / MANIFEST).is_file():  # another build's (`_reused` said it is not this one)
        if not opts.overwrite:  # written by a run that held the lock since _refuse_early looked
            raise _other_dataset(out)
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
    read = ReadOptions(opts.text_field, opts.skip_bad_records, opts.sample_by, opts.encoding_errors)
    tokenizer = _tokenizer(opts, out, build_key, inputs, read, work)
    eos_token, eos_id = find_eos_id(tokenizer, opts.eos_token or None)
    vocab_size = vocab_size_of(tokenizer)
    dtype = _token_dtype(opts.dtype, vocab_size)
    logging_dir = _pipeline_dir(out, build_key)
    records_dir = logging_dir / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    _forget_damaged_tasks(out, logging_dir, records_dir, opts.tasks)
    console = opts.progress or opts.executor != "local"  # slurm's and ray's console is their log
    pipeline = [ReadInputs(inputs, read, out, records_dir, console),
                TokenizeToShards(tokenizer.to_str(), eos_id,
                                 ShardOptions(out, build_key, dtype.str, opts.shard_tokens, opts.val_fraction,
                                              opts.seed), records_dir)]
    to_run = _unfinished_tasks(logging_dir, opts.tasks)
    datatrove_logging(opts.progress)
    try:
        run_pipeline(pipeline, ExecutorOptions(**{k: getattr(opts, k) for k in _RUN_OPTIONS | {"tasks"}}),
                     logging_dir, f"prepare-{build_key[:8]}", opts.progress)
    finally:
        datatrove_logging(True)
    tasks = [read_json_object(task_record_path(records_dir, t), DataError) for t in range(opts.tasks)]
    reads = [read_json_object(read_report_path(records_dir, t), DataError) for t in range(opts.tasks)]
    splits = {name: split_summary([r for task in tasks for r in task["splits"][name]]) for name in SPLITS}
    _check_splits(splits, opts.val_fraction)
    _remove_stale_files(out, splits)
    bad_records = sum(r["bad_records"] for r in reads)
    write_manifest(out, new_manifest(
        build_key,
        tokenizer={"file": TOKENIZER_FILE, "sha256": tokenizer_sha256(tokenizer),
                   "vocab_size": vocab_size, "eos_token": eos_token, "eos_id": eos_id},
        dtype=dtype, splits=splits,
        created_by=f"trinity-train {__version__}",
        inputs={"files": [str(p) for p, _ in inputs.files], "hub": inputs.hub_name,
                "bytes": inputs.total_bytes(), "text_field": opts.text_field},
        val_fraction=opts.val_fraction, seed=opts.seed, tasks=opts.tasks, shard_tokens=opts.shard_tokens,
        bad_records_skipped=bad_records))
    opts.stats.update(reused=False, input_bytes=inputs.total_bytes(), tasks_run=to_run,
                      train_tokens=splits["train"]["num_tokens"], val_tokens=splits["val"]["num_tokens"],
                      documents=sum(s["num_documents"] for s in splits.values()), bad_records=bad_records,
                      bad_examples=[e for r in reads for e in r["bad_examples"]][:3])


def _check_splits(splits: dict, val_fraction: float) -> None:
    n = sum(s["num_documents"] for s in splits.values())
    if splits["train"]["num_tokens"] == 0 and n == 0:
        raise DataError("the input holds no text: every document is empty")
    if splits["train"]["num_documents"] == 0 or (val_fraction > 0 and splits["val"]["num_documents"] == 0):
        raise DataError(f"the input holds only {n} document(s): too few to hold out a validation split of "
                        f"{val_fraction} (documents are held out by a hash of their text); add documents, "
                        "change --val-fraction or --seed, or pass --val-fraction 0")


def _pipeline_dir(out: Path, build_key: str) -> Path:
    """datatrove's logging directory for this build (completion markers, logs, task records);
    those of other builds go, since their tasks wrote other shards."""
    root = out / _PIPELINE_DIR
    if root.is_dir():
        for other in root.iterdir():
            if other.name != build_key[:16]:
                shutil.rmtree(other, ignore_errors=True)
    return root / build_key[:16]


def _unfinished_tasks(logging_dir: Path, tasks: int) -> list[int]:
    return [t for t in range(tasks) if not (logging_dir / "completions" / f"{t:05d}").is_file()]


def _forget_damaged_tasks(out: Path, logging_dir: Path, records_dir: Path, tasks: int) -> None:
    """A task marked complete whose record or files are gone or changed size runs again."""
    for task in range(tasks):
        marker = logging_dir / "completions" / f"{task:05d}"
        if marker.is_file() and not _task_intact(out, records_dir, task):
            marker.unlink()


def _task_intact(out: Path, records_dir: Path, task: int) -> bool:
    try:
        record = read_json_object(task_record_path(records_dir, task), DataError)
        read_json_object(read_report_path(records_dir, task), DataError)
        return all((out / split / name).is_file() and (out / split / name).stat().st_size == info["bytes"]
                   for split in SPLITS for shard in record["splits"][split]
                   for name, info in shard["files"].items())
    except (DataError, KeyError, TypeError, AttributeError):
        return False


def _check_options(opts: PrepareOptions) -> None:
    """Option values no input can make right are usage mistakes (ConfigError: exit 2)."""
    if opts.train_tokenizer and opts.train_tokenizer < MIN_BPE_VOCAB or opts.train_tokenizer < 0:
        raise _vocabulary_too_small(opts.train_tokenizer)
    if bool(opts.tokenizer) == bool(opts.train_tokenizer):
        raise ConfigError("give exactly one of --tokenizer PATH and --train-tokenizer VOCAB")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {opts.val_fraction}")
    if opts.shard_tokens < 1 or opts.tokenizer_sample_bytes < 1:
        raise ConfigError("--shard-tokens and --tokenizer-sample-bytes must be positive")
    for name, value, allowed in (("--format", opts.format, ("auto", *FORMATS)),
                                 ("--dtype", opts.dtype, ("auto", "uint16", "uint32")),
                                 ("--sample-by", opts.sample_by, ("document", "paragraph", "line")),
                                 ("--encoding-errors", opts.encoding_errors, ("strict", "replace", "ignore"))):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got '{value}'")
    check_executor_options(ExecutorOptions(**{k: getattr(opts, k) for k in _RUN_OPTIONS | {"tasks"}}))


def _vocabulary_too_small(vocab: int) -> ConfigError:
    return ConfigError(f"--train-tokenizer must be a vocabulary size of at least {MIN_BPE_VOCAB}, got {vocab} "
                       "(a byte-level BPE holds every byte plus the end-of-document and padding tokens)")


def _existing(path: str) -> Path:
    load_tokenizer(path)  # the one clear message for a missing or unreadable tokenizer
    return Path(path).expanduser()


def _build_key(opts: PrepareOptions, input_fingerprint: list, tokenizer_spec: dict) -> str:
    options = asdict(opts)
    for irrelevant in ("inputs", "out", "tokenizer", "overwrite", "progress", "stats", *_RUN_OPTIONS):
        options.pop(irrelevant)
    if not opts.train_tokenizer:
        options.pop("tokenizer_sample_bytes")  # only what a trained tokenizer is trained on
    payload = {"format_version": FORMAT_VERSION, "inputs": input_fingerprint,
               "tokenizer": tokenizer_spec, "options": options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _tokenizer(opts: PrepareOptions, out: Path, build_key: str, inputs: Inputs, read: ReadOptions,
               work: Path) -> Tokenizer:
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
        tokenizer = _train_on_sample(opts, inputs, read, work)
    atomic_write_text(path, tokenizer.to_str())
    if opts.train_tokenizer:
        atomic_write_json(out / _TRAINED_TOKENIZER_RECORD, {"build_key": build_key, "sha256": file_sha256(path)})
    return tokenizer


def _train_on_sample(opts: PrepareOptions, inputs: Inputs, read: ReadOptions, work: Path) -> Tokenizer:
    """A BPE trained on the training documents (not the held-out ones) of the first input files,
    in input order, up to `tokenizer_sample_bytes` of them; on one machine, before the pipeline."""
    sample = Inputs(files=[], hub_name=inputs.hub_name, hub_config=inputs.hub_config, hub_split=inputs.hub_split)
    size = 0
    for path, fmt in inputs.files:
        if size >= opts.tokenizer_sample_bytes:
            break
        sample.files.append((path, fmt))
        size += path.stat().st_size
    docs, _ = load_documents(sample, cache_dir=work, **asdict(read))

    def training_texts():
        for batch in docs.iter(batch_size=_SAMPLE_BATCH):
            texts = batch[TEXT]
            held_out = is_validation(texts, opts.seed, opts.val_fraction)
            yield [t for t, out in zip(texts, held_out) if not out]

    return train_byte_level_bpe(training_texts(), opts.train_tokenizer, len(docs))


def _token_dtype(requested: str, vocab_size: int) -> np.dtype:
    fitting = token_dtype_for(vocab_size)
    if requested == "auto":
        return fitting
    dtype = np.dtype("<u2" if requested == "uint16" else "<u4")
    if dtype.itemsize < fitting.itemsize:
        raise DataError(f"the tokenizer's vocabulary of {vocab_size} does not fit in {requested} "
                        f"(at most {1 << 16} ids); use --dtype uint32 or auto")
    return dtype


def _remove_stale_files(out: Path, splits: dict) -> None:
    """Shards of an earlier, different build that this one did not overwrite, and temporary files
    of a killed task."""
    for split, info in splits.items():
        keep = {p.name for s in info["shards"] for p in shard_paths(out / split, s["index"])}
        if (out / split).is_dir():
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
    parser.add_argument("--shard-tokens", type=int, default=d.shard_tokens,
                        help="tokens per shard at most (a longer document gets a shard alone); default 2^30: "
                             "2 GiB of uint16 ids")
    parser.add_argument("--tokenizer-sample-bytes", type=int, default=d.tokenizer_sample_bytes,
                        help="with --train-tokenizer: train on the first input files up to this many bytes")
    parser.add_argument("--tasks", type=int, default=d.tasks,
                        help="pipeline tasks; input files go to tasks round-robin, so the task count is "
                             "part of the token order (and of the build key)")
    parser.add_argument("--workers", "--num-proc", dest="workers", type=int, default=d.workers,
                        help="tasks run at once (0: local, one per CPU; slurm/ray, no limit); does not "
                             "change the output (--num-proc is its former name)")
    parser.add_argument("--executor", default=d.executor, metavar="{" + ",".join(EXECUTORS) + "}",
                        help="where the tasks run: local processes, SLURM array jobs (sbatch), or Ray")
    parser.add_argument("--slurm-partition", default=d.slurm_partition, help="--executor slurm: the partition")
    parser.add_argument("--slurm-time", default=d.slurm_time, help="--executor slurm: a task's time limit")
    parser.add_argument("--cpus-per-task", type=int, default=d.cpus_per_task,
                        help="--executor slurm/ray: CPUs reserved for a task")
    parser.add_argument("--mem-per-cpu-gb", type=int, default=d.mem_per_cpu_gb,
                        help="--executor slurm/ray: memory reserved per CPU, GB")
    parser.add_argument("--ray-address", default=d.ray_address,
                        help="--executor ray: a running cluster's address (default: start Ray here)")
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
          f"documents ({s['bad_records']} bad records skipped; {len(s['tasks_run'])} of {opts.tasks} tasks run "
          f"now); {mb:.1f} MB in {s['seconds']:.1f} s "
          f"= {mb / s['seconds']:.2f} MB/s, {tokens / s['seconds']:,.0f} tokens/s")
    return 0
