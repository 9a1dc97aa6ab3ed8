"""Whether a checkpoint is whole: every file's checksum in `meta.json`, checked before a resume.

A save records, for every file of the checkpoint but `meta.json` itself, its size and its
xxh3-128 digest (`meta.json` -> `"files"`). `check_integrity` proves a checkpoint is the one that
was written: structure (meta.json with a config, a readable DCP `.metadata`, every data file it
points at present and long enough), then every recorded file's size and digest; `deep=True` also
reads every tensor back and requires it to be finite (model and optimizer state alike). A
flipped byte anywhere, a truncated shard, a replaced `.metadata` or an edited weight fails the
fast check.

xxh3-128 was chosen by measurement (`benchmarks/checkpoint_hash.py`, benchmarks/README.md): it
hashes at several GB/s, a few per cent of the save itself, where sha256 costs a quarter of it.
The digest guards against accidents (bad disks, torn copies, truncation), not against an attacker.

In a distributed run every rank hashes the files it wrote (DCP names them `__{rank}_{n}.distcp`),
the coordinator also hashes the rest (`.metadata`), and the coordinator writes them all into
`meta.json`. `find_sound_checkpoint` is collective then: rank 0 decides, every rank gets its answer.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.compat import config_from_meta
from trinity_train.checkpoint.layout import META_FILE, read_meta, step_of
from trinity_train.errors import CheckpointError
from trinity_train.rank_zero import decided_by_rank_zero

CHECKSUM = "xxh3_128"  # the key of each file's digest in meta.json's "files"
_CHUNK = 1 << 22
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files_to_hash(directory: Path, rank: int, world: int) -> list[Path]:
    """The files of a checkpoint directory that `rank` hashes: its own DCP shards, and on rank 0
    every other file but meta.json (`.metadata`, and anything DCP names another way)."""
    mine = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name == META_FILE:
            continue
        match = _RANK_FILE.match(path.name)
        owner = int(match.group(1)) if match and int(match.group(1)) < world else 0
        if owner == rank:
            mine.append(path)
    return mine


def digest_files(directory: Path, rank: int = 0, world: int = 1) -> dict[str, dict[str, Any]]:
    """{file name: {"bytes", CHECKSUM}} of the files of `directory` that `rank` hashes."""
    return {p.name: {"bytes": p.stat().st_size, CHECKSUM: file_digest(p)}
            for p in _files_to_hash(directory, rank, world)}


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any unpickling/IO failure means the same thing to the user
        raise CheckpointError(f"checkpoint '{path}' has an unreadable DCP .metadata file: {e}") from None


def component_of(fqn: str) -> str:
    return fqn.split(".", 1)[0]


def _check_data_files(path: Path, dcp_meta: Metadata) -> None:
    needed: dict[str, int] = defaultdict(int)
    for info in (dcp_meta.storage_data or {}).values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is incomplete: data file '{name}' is missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"checkpoint '{path}' is truncated: '{name}' has {file.stat().st_size} "
                                  f"bytes, the metadata needs {end}")


def _check_checksums(path: Path, files: Any) -> None:
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"checkpoint '{path}' has a {META_FILE} without file checksums")
    for name, record in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is incomplete: '{name}' is missing")
        size, written = file.stat().st_size, record.get("bytes")
        if size != written:
            how = "truncated" if isinstance(written, int) and size < written else "damaged"
            raise CheckpointError(f"checkpoint '{path}' is {how}: '{name}' has {size} bytes, "
                                  f"{written} were written")
        if file_digest(file) != record.get(CHECKSUM):
            raise CheckpointError(f"checkpoint '{path}' is damaged: '{name}' does not match its "
                                  f"{CHECKSUM} checksum in {META_FILE}")


def _empty_like_metadata(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None  # a pickled object; DCP replaces the placeholder with what it reads


def read_back(path: Path, dcp_meta: Metadata, finite: Callable[[str], bool]) -> None:
    """Read every item back, one component at a time (memory stays bounded by the largest); the
    floating-point tensors of the components `finite(component)` selects must be finite."""
    for component in sorted({component_of(fqn) for fqn in dcp_meta.state_dict_metadata}):
        template = {fqn: _empty_like_metadata(md) for fqn, md in dcp_meta.state_dict_metadata.items()
                    if component_of(fqn) == component}
        dcp_io.load(template, path)
        if not finite(component):
            continue
        bad = [fqn for fqn, t in template.items()
               if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise CheckpointError(f"checkpoint '{path}' has non-finite values in {len(bad)} {component} "
                                  f"tensor(s), first {bad[0]}")


def check_integrity(path: str | Path, deep: bool = False) -> None:
    """Raise CheckpointError with the reason when the checkpoint at `path` is not whole.

    The fast check (structure, sizes, checksums) reads every file once; `deep` also loads every
    tensor and requires the floating-point ones to be finite. The fast check's verdict is
    remembered for `require_sound`.
    """
    path = Path(path)
    version = _files_version(path)
    try:
        _check_integrity(path, deep)
    except CheckpointError as e:
        if not deep:
            _FRESH_VERDICTS[path.resolve()] = (version, str(e))
        raise
    _FRESH_VERDICTS[path.resolve()] = (version, None)


# path -> (its files' version, the error or None) of the latest check_integrity in this process.
_FRESH_VERDICTS: dict[Path, tuple[Any, str | None]] = {}


def require_sound(path: str | Path) -> None:
    """The gate in front of every reader of a checkpoint's weights (resume, rollback, init_from,
    export-hf, inspect): CheckpointError naming the damaged file unless the checkpoint passes the
    fast `check_integrity`. A verdict this process reached by hashing, with none of the files
    changed since, is not hashed again (a resume or rollback picks a checkpoint by checking it,
    then loads it). Collective in a distributed run: rank 0 checks, every rank gets its answer."""
    decided_by_rank_zero(lambda: _sound_or_raise(Path(path)))


def _sound_or_raise(path: Path) -> None:
    known = _FRESH_VERDICTS.get(path.resolve())
    if known is None or known[0] != _files_version(path):
        check_integrity(path)
    elif known[1] is not None:
        raise CheckpointError(known[1])


def _check_integrity(path: Path, deep: bool) -> None:
    meta = read_meta(path)
    config_from_meta(meta, path)  # a checkpoint without a readable config cannot be resumed
    _check_checksums(path, meta.get("files"))  # before DCP reads a possibly damaged .metadata
    dcp_meta = read_dcp_metadata(path)
    saved = {component_of(fqn) for fqn in dcp_meta.state_dict_metadata}
    missing = sorted(set(meta.get("components", [])) - saved)
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is missing components {', '.join(missing)} listed "
                              f"in {META_FILE}")
    _check_data_files(path, dcp_meta)
    if deep:
        read_back(path, dcp_meta, finite=lambda component: True)


def candidate_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Every directory named like a checkpoint (`step_XXXXXXXX`), complete or not, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    return sorted((step, p) for p in checkpoints_dir.iterdir() if (step := step_of(p)) is not None)


def newest_sound_checkpoint(checkpoints_dir: Path, max_step: int | None = None
                            ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`find_sound_checkpoint` in this process alone (no collective): the checkpoint, and the
    (path, reason) of each damaged one passed over, newest first."""
    passed_over = []
    for step, path in reversed(candidate_checkpoints(Path(checkpoints_dir))):
        if max_step is not None and step > max_step:
            continue
        try:
            check_integrity(path)
        except CheckpointError as e:
            passed_over.append((path, str(e)))
            continue
        return path, passed_over
    return None, passed_over


def find_sound_checkpoint(checkpoints_dir: str | Path, max_step: int | None = None,
                          on_passed_over: Callable[[Path, str], None] | None = None) -> Path | None:
    """The newest complete checkpoint under `checkpoints_dir` with step <= `max_step` (any step
    when None) that passes the fast `check_integrity`; None when there is none.

    `on_passed_over(path, reason)` is called for each newer one that was damaged, newest first.
    In a distributed run this is collective (every rank must call it): rank 0 checks, and every
    rank gets the same answer and the same `on_passed_over` calls.
    """
    found, passed_over = decided_by_rank_zero(lambda: newest_sound_checkpoint(Path(checkpoints_dir), max_step))
    if on_passed_over is not None:
        for path, reason in passed_over:
            on_passed_over(path, reason)
    return found


class SoundnessCache:
    """The fast `check_integrity` verdict of each checkpoint, remembered while none of its files
    changed (name, size, modification time): retention asks about the same few checkpoints at every
    save, and hashing them each time would cost as much as the save. A file rewritten or cut short
    since is noticed; bits rotting in place are left to the check before a resume."""

    def __init__(self):
        self._verdicts: dict[Path, tuple[Any, bool]] = {}

    def is_sound(self, path: Path) -> bool:
        version = _files_version(path)
        known = self._verdicts.get(path)
        if known is None or known[0] != version:
            try:
                check_integrity(path)
                known = (version, True)
            except CheckpointError:
                known = (version, False)
            self._verdicts[path] = known
        return known[1]

    def vouch(self, path: Path) -> None:
        """`path` is sound without a check: this process has just written it and its checksums."""
        self._verdicts[path] = (_files_version(path), True)


def _files_version(path: Path) -> Any:
    try:
        return sorted((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in path.iterdir())
    except OSError:
        return None
