"""`trinity-train import-data`: another tool's tokenized corpus -> a prepared dataset, tokens not copied.

The token files of datatrove, Megatron and dolma are raw little-endian uint16/uint32 arrays, which
is our shard layout already (`import_formats.py`), so a shard's .bin is a hard link to the tool's
token file (a symlink where the two directories lie on different filesystems): no token is
copied. What is written is ours alone: the .idx document offsets (from the tool's index), the
shard records, tokenizer.json and, last, manifest.json.

The validation split is the trailing `--val-fraction` of each token file's documents: a split must
be a contiguous range of a token file to need no copy, and a range shared with training would
leak. Both splits link the same file; each shard's record names its `token_range`.

Checks, each a one-line DataError: the index accounts for exactly the token file's bytes; every id
is below the tokenizer's vocabulary (one read of every token file, which also gives the sha256
the records carry); the dtype the tool recorded fits that vocabulary; and every document ends
with the tokenizer's EOS, as every prepared document does: the loader trains the last token of a
document to predict the first of the next, which is right only when that token is EOS.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trinity_train import __version__
from trinity_train.data.import_formats import (FORMATS, TOKEN_SUFFIXES, TokenFile, index_files, read_token_file,
                                               token_files)
from trinity_train.data.shards import (FORMAT_VERSION, MANIFEST, OFFSET_DTYPE, SPLITS, TOKENIZER_FILE, new_manifest,
                                       read_manifest, sha256_and_largest_id, shard_paths, shard_record,
                                       split_summary, token_dtype_for, write_manifest, write_shard_record)
from trinity_train.data.tokenizer import find_eos_id, load_tokenizer, tokenizer_sha256, vocab_size_of
from trinity_train.errors import ConfigError, DataError
from trinity_train.files import atomic_open, atomic_write_text, output_directory, temp_sibling, user_path

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# A link across filesystems (EXDEV) or where hard links are not allowed falls back to a symlink.
_NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES}


@dataclass
class ImportOptions:
    inputs: list[str]
    out: str
    tokenizer: str
    format: str = "auto"  # or one of import_formats.FORMATS, for every input
    eos_token: str = ""  # "" finds the usual names (<|endoftext|>, </s>, ...)
    dtype: str = "auto"  # the tool's record (Megatron .idx, datatrove .ds.metadata), else by the vocabulary
    val_fraction: float = 0.02


@dataclass
class ImportResult:
    out: Path
    reused: bool
    train_tokens: int = 0
    val_tokens: int = 0
    documents: int = 0
    links: tuple[str, ...] = ()  # "hard link" or "symlink", per token file


def import_corpus(opts: ImportOptions) -> ImportResult:
    """Make `opts.out` a prepared dataset over the token files of `opts.inputs`; returns what it did."""
    _check_options(opts)
    if not user_path(opts.tokenizer).is_file():
        raise DataError(f"--tokenizer '{opts.tokenizer}' is not a file: pass the tokenizer.json the corpus was "
                        "tokenized with")
    tokenizer = load_tokenizer(opts.tokenizer)
    eos_token, eos_id = find_eos_id(tokenizer, opts.eos_token or None)
    vocab_size = vocab_size_of(tokenizer)
    sources = [(fmt, path) for text in opts.inputs for fmt, path in _input_files(opts.format, user_path(text))]
    build_key = _build_key(opts, sources, tokenizer_sha256(tokenizer))
    out = user_path(opts.out)
    if (out / MANIFEST).is_file() and read_manifest(out).get("build_key") == build_key:
        return ImportResult(out, reused=True)
    out = output_directory(out, "--out", new=True)
    files = [read_token_file(fmt, path) for fmt, path in sources]
    dtype = _dtype(files, opts.dtype, vocab_size)
    checked = [_checked(f, dtype, vocab_size, opts.tokenizer, eos_token, eos_id) for f in files]
    n_val = _validation_documents([ends for ends, _ in checked], opts.val_fraction)
    # Every file passed every check: only now is anything written.
    splits, links = {name: [] for name in SPLITS}, []
    for index, (f, (ends, tokens_info), val_docs) in enumerate(zip(files, checked, n_val)):
        cut = len(ends) - val_docs
        for split, docs in zip(SPLITS, ((0, cut), (cut, len(ends)))):
            if docs[1] > docs[0]:
                record, how = _link_shard(out / split, index, f.tokens, ends, docs, build_key, tokens_info)
                splits[split].append(record)
                links.append(how)
    summaries = {name: split_summary(records) for name, records in splits.items()}
    atomic_write_text(out / TOKENIZER_FILE, tokenizer.to_str())
    write_manifest(out, new_manifest(
        build_key,
        tokenizer={"file": TOKENIZER_FILE, "sha256": tokenizer_sha256(tokenizer), "vocab_size": vocab_size,
                   "eos_token": eos_token, "eos_id": eos_id},
        dtype=dtype, splits=summaries, created_by=f"trinity-train {__version__}",
        imported_from={"files": [{"format": fmt, "tokens": str(f.tokens.resolve()),
                                  "index": str(f.index.resolve())} for (fmt, _), f in zip(sources, files)]},
        val_fraction=opts.val_fraction))
    return ImportResult(out, reused=False, train_tokens=summaries["train"]["num_tokens"],
                        val_tokens=summaries["val"]["num_tokens"],
                        documents=sum(s["num_documents"] for s in summaries.values()), links=tuple(links))


def _check_options(opts: ImportOptions) -> None:
    """Option values no input can make right are usage mistakes (ConfigError: exit 2)."""
    for name, value, allowed in (("--format", opts.format, ("auto", *FORMATS)),
                                 ("--dtype", opts.dtype, ("auto", *_DTYPES))):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got '{value}'")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {opts.val_fraction}")
    if not opts.inputs:
        raise ConfigError("give the token files (or directories of them) to import")


def _input_files(fmt: str, path: Path) -> list[tuple[str, Path]]:
    """(format, token file) of every token file an input names."""
    if fmt == "auto":
        fmt = _format_of(path)
    return [(fmt, p) for p in token_files(fmt, path)]


def _format_of(path: Path) -> str:
    name = path.name if path.is_file() else ""
    for fmt, suffix in TOKEN_SUFFIXES.items():
        if name.endswith(suffix) or (fmt == "megatron" and name.endswith(".idx")):
            return fmt
    if path.is_dir():
        found = {fmt for fmt, suffix in TOKEN_SUFFIXES.items() if any(path.glob(f"*{suffix}"))}
        if len(found) == 1:
            return found.pop()
    if not path.is_dir() and path.with_name(path.name + ".bin").is_file():
        return "megatron"  # a data prefix
    what = "does not exist" if not path.exists() else "is not a token file of a known format"
    raise DataError(f"input '{path}' {what}: give datatrove *.ds, Megatron *.bin (or its prefix) or dolma *.npy "
                    "files or a directory of one kind, or name the format with --format " + "|".join(FORMATS))


def _build_key(opts: ImportOptions, sources: list[tuple[str, Path]], tokenizer_hash: str) -> str:
    """What the dataset is made of: the files (path, size, mtime), the tokenizer and the options."""
    files = []
    for fmt, path in sources:
        for p in (path, *index_files(fmt, path)):
            if p.is_file():
                files.append([fmt, str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns])
    payload = {"format_version": FORMAT_VERSION, "files": files, "tokenizer": tokenizer_hash,
               "eos_token": opts.eos_token, "dtype": opts.dtype, "val_fraction": opts.val_fraction}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _dtype(files: list[TokenFile], requested: str, vocab_size: int) -> np.dtype:
    """One dtype for every file: the tools' records must agree with each other and with --dtype;
    where none records one, --dtype or what datatrove and dolma choose for the vocabulary."""
    recorded = {f.dtype for f in files if f.dtype is not None}
    wanted = _DTYPES.get(requested)
    if len(recorded) > 1 or (wanted is not None and recorded and recorded != {wanted}):
        names = sorted({f"'{f.index}': {f.dtype.name}" for f in files if f.dtype is not None})
        also = f" and --dtype {requested}" if wanted is not None else ""
        raise DataError(f"mismatched token dtypes ({', '.join(names)}{also}): one prepared dataset holds one dtype; "
                        "import the files of each dtype separately and mix them with data.mix")
    dtype = recorded.pop() if recorded else wanted or token_dtype_for(vocab_size)
    if dtype.itemsize < token_dtype_for(vocab_size).itemsize:
        raise DataError(f"the token files hold {dtype.name} ids but the tokenizer has {vocab_size:,} tokens, more "
                        f"than {dtype.name} can number: they were made with another tokenizer (or, where no index "
                        "records the dtype, pass --dtype uint32)")
    return dtype


def _validation_documents(doc_ends: list[np.ndarray], val_fraction: float) -> list[int]:
    """How many trailing documents of each file are held out."""
    counts = [len(ends) for ends in doc_ends]
    n_val = [round(n * val_fraction) for n in counts]
    if sum(counts) - sum(n_val) < 1 or (val_fraction > 0 and sum(n_val) == 0):
        raise DataError(f"the input holds {sum(counts)} document(s): too few to hold out a validation split of "
                        f"{val_fraction} per file and train on the rest; add documents or change --val-fraction")
    return n_val


def _checked(f: TokenFile, dtype: np.dtype, vocab_size: int, tokenizer: str, eos_token: str,
             eos_id: int) -> tuple[np.ndarray, dict]:
    """A token file's document ends and its record entry ({"bytes", "sha256", "max_token_id"}),
    once its size, ids and document ends passed their checks."""
    f.check_size(dtype)
    digest, largest = sha256_and_largest_id(f.tokens, dtype)
    if largest >= vocab_size:
        raise DataError(f"'{f.tokens}' holds token id {largest}, outside the vocabulary of {vocab_size} of "
                        f"'{tokenizer}': it was tokenized with another tokenizer (or read as the wrong dtype); "
                        "pass the tokenizer.json it was made with")
    ends = _documents_ending_with_eos(f, dtype, eos_token, eos_id)
    return ends, {"bytes": f.tokens.stat().st_size, "sha256": digest, "max_token_id": largest}


def _documents_ending_with_eos(f: TokenFile, dtype: np.dtype, eos_token: str, eos_id: int) -> np.ndarray:
    """The file's document ends with empty documents dropped (they hold no tokens), checked to
    close every document with EOS."""
    ends = np.unique(f.doc_ends[f.doc_ends > 0])
    if not ends.size:
        return ends
    last_tokens = np.memmap(f.tokens, dtype=dtype, mode="r")[ends - 1]
    missing = np.flatnonzero(last_tokens != eos_id)
    if missing.size:
        raise DataError(f"{missing.size:,} of the {ends.size:,} documents of '{f.tokens}' do not end with the EOS "
                        f"token '{eos_token}' (id {eos_id}), the first is document {int(missing[0])}; trinity-train "
                        "trains each document's last token to predict the next document, so tokenize with EOS "
                        "appended (datatrove: DocumentTokenizer(eos_token=...); Megatron: preprocess_data.py "
                        "--append-eod; dolma: its tokenizer's eos) or name the end token with --eos-token")
    return ends


def _link_shard(split_dir: Path, index: int, source: Path, ends: np.ndarray, docs: tuple[int, int],
                build_key: str, tokens_info: dict) -> tuple[dict, str]:
    """Shard `index` of a split: documents [docs) of `source`, linked, with our index and record."""
    tokens_path, offsets_path, record_path = shard_paths(split_dir, index)
    split_dir.mkdir(parents=True, exist_ok=True)
    start, end = (int(ends[docs[0] - 1]) if docs[0] else 0), int(ends[docs[1] - 1])
    offsets = np.concatenate([[0], ends[docs[0]:docs[1]] - start]).astype(OFFSET_DTYPE).tobytes()
    with atomic_open(offsets_path, "wb") as f:
        f.write(offsets)
    how = _link(source, tokens_path)
    record = shard_record(index, build_key, end - start, docs[1] - docs[0], tokens_info["max_token_id"],
                          tokens={"bytes": tokens_info["bytes"], "sha256": tokens_info["sha256"]},
                          offsets={"bytes": len(offsets), "sha256": hashlib.sha256(offsets).hexdigest()},
                          token_range=(start, end))
    return write_shard_record(record_path, record), how


def _link(source: Path, dest: Path) -> str:
    """`dest` becomes `source` itself: a hard link, else (another filesystem) a symlink; never a copy."""
    tmp = temp_sibling(dest)
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
        how = "hard link"
    except OSError as e:
        if e.errno not in _NO_HARD_LINK:
            raise
        os.symlink(source.resolve(), tmp)
        how = "symlink"
    os.replace(tmp, dest)
    return how


# ---------------------------------------------------------------------------- command line


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    d = ImportOptions(inputs=[], out="", tokenizer="")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="token files (datatrove *.ds, Megatron *.bin or its prefix, dolma *.npy), each with its "
                             "index beside it, or directories of them")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the prepared dataset directory to create (new or empty; on the token files' "
                             "filesystem for hard links)")
    parser.add_argument("--tokenizer", required=True, metavar="PATH",
                        help="the tokenizers tokenizer.json the corpus was tokenized with")
    parser.add_argument("--format", default=d.format, metavar="|".join(("auto", *FORMATS)),
                        help="the tool that wrote the inputs (default auto: from the file names)")
    parser.add_argument("--eos-token", default=d.eos_token,
                        help="the token every document ends with (default: found in the tokenizer)")
    parser.add_argument("--dtype", default=d.dtype, metavar="auto|uint16|uint32",
                        help="token id dtype (default auto: the tool's own record, else uint16 when the "
                             "vocabulary fits, as datatrove and dolma choose)")
    parser.add_argument("--val-fraction", type=float, default=d.val_fraction,
                        help="fraction of each token file's documents, its last ones, held out for validation")


def run_import(args: argparse.Namespace) -> int:
    """Run `import-data` from parsed arguments; a UserError propagates for the CLI to print."""
    names = set(ImportOptions.__dataclass_fields__)
    result = import_corpus(ImportOptions(**{k: v for k, v in vars(args).items() if k in names}))
    if result.reused:
        print(f"{result.out}: already imported from these files; nothing to do")
        return 0
    kinds = ", ".join(f"{result.links.count(k)} {k}{'s' * (result.links.count(k) > 1)}"
                      for k in sorted(set(result.links)))
    print(f"{result.out}: {result.train_tokens:,} train + {result.val_tokens:,} val tokens from "
          f"{result.documents:,} documents, token files linked ({kinds}), none copied")
    return 0
