"""The embedded default corpus: the running interpreter's own standard library source.

It exists on every machine, so `trinity-train train` works with no data at all. The corpus is
every `*.py` file under `sysconfig.get_paths()["stdlib"]`, sorted, excluding `site-packages`
and `dist-packages` (third-party code whose size varies from machine to machine). The standard
library's own tests stay in: they double the corpus (CPython 3.11: ~1,800 files, ~31 MB,
~8.6M tokens with the 8k BPE), which keeps it near the ~10M tokens the debug model wants while
still building in seconds. Each file is one document.

It is built by the same `prepare()` as `prepare-data` (an 8k byte-level BPE trained on it, a held-out
validation split, two pipeline tasks), under `data.cache_dir`, in a directory keyed by the Python version, the file list
and the data options, so another interpreter gets its own. prepare()'s file lock makes concurrent
first runs (several torchrun ranks) safe: one builds, the others wait and then reuse it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from trinity_train.config import DataConfig
from trinity_train.data.prepare import PrepareOptions, prepare
from trinity_train.data.shards import FORMAT_VERSION, MANIFEST

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SPLIT_SEED = 0  # which files are held out; fixed so that data.seed only changes the order
_TASKS = 2  # pipeline tasks (part of the token order): two local worker processes on a 2-CPU machine


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[Path]:
    """The corpus, deterministic: sorted paths, no third-party packages, no empty files."""
    return sorted(p for p in root.rglob("*.py")
                  if p.is_file() and p.stat().st_size > 0
                  and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts))


def corpus_dir(cfg: DataConfig, root: Path, files: list[Path]) -> Path:
    """Where this interpreter's corpus lives for these options."""
    listing = [[str(p.relative_to(root)), p.stat().st_size] for p in files]
    key = hashlib.sha256(json.dumps({
        "python": sys.version, "files": listing, "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction, "format_version": FORMAT_VERSION, "tasks": _TASKS,
    }, sort_keys=True).encode()).hexdigest()[:16]
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    return Path(cfg.cache_dir).expanduser() / f"stdlib-py{version}-{key}"


def default_dataset_dir(cfg: DataConfig) -> Path:
    """Where `default_dataset` keeps this interpreter's corpus (built there or not)."""
    root = stdlib_root()
    return corpus_dir(cfg, root, corpus_files(root))


def default_dataset(cfg: DataConfig, root: Path | None = None, progress: bool = True) -> Path:
    """The prepared default corpus, built on first use; returns its directory."""
    root = root or stdlib_root()
    files = corpus_files(root)
    out = corpus_dir(cfg, root, files)
    if (out / MANIFEST).is_file():
        return out
    print(f"the default corpus ({len(files)} standard-library files of Python {sys.version.split()[0]}) "
          f"is built once, in {out}", file=sys.stderr)
    # prepare() holds a lock on `out`: of concurrent first runs one builds, the others wait for it
    # and then find its manifest.
    return prepare(PrepareOptions(
        inputs=[str(p) for p in files], out=str(out), format="text", sample_by="document",
        encoding_errors="replace",  # a few test files are deliberately not UTF-8
        train_tokenizer=cfg.vocab_size, val_fraction=cfg.val_fraction, seed=_SPLIT_SEED,
        tasks=_TASKS, progress=progress))
