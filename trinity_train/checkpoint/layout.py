"""Where checkpoints live on disk and how a directory becomes one atomically.

A checkpoint is a directory `step_00000100/` holding the DCP files and, written last, `meta.json`.
It is written as `step_00000100.tmp/` and renamed, so a checkpoint directory with its final name
is complete; anything else (`*.tmp`, `*.old`, a directory without `meta.json`) is ignored and
cleaned up. Filesystem changes are made by one process (the coordinator, rank 0; rank_zero.py).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

from trinity_train.errors import CheckpointError
from trinity_train.files import atomic_write_json, read_json_object

META_FILE = "meta.json"
DCP_METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint once all ranks finished
DCP_DATA_SUFFIX = ".distcp"  # each rank's tensors, written before .metadata
FORMAT = "trinity-train-checkpoint"
# The state of the first release: every file's size and checksum in meta.json, the guard's windows,
# warm-up and routing watches, the LR back-off. Versions 1-3 were pre-release and are not read.
FORMAT_VERSION = 4
READABLE_VERSIONS = (4,)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# checkpoints/abandoned/: the checkpoints of a future a resume from an earlier step left behind,
# kept for a person to look at; one level down, nothing that lists checkpoints ever sees them.
ABANDONED_DIR = "abandoned"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a directory named like a checkpoint (`step_00000100`), else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `checkpoints_dir`, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_checkpoint(checkpoints_dir: Path) -> Path | None:
    found = list_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def remove_incomplete(checkpoints_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`*.tmp`, `*.old`); returns what was removed."""
    removed = []
    if checkpoints_dir.is_dir():
        for entry in checkpoints_dir.iterdir():
            if entry.is_dir() and entry.suffix in (".tmp", ".old"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def commit(tmp_dir: Path, final_dir: Path, meta: dict) -> None:
    """Write `meta.json` into `tmp_dir` (last file of the checkpoint), then rename it into place.

    A directory of the same name from an earlier run is moved aside first (POSIX rename does not
    replace a non-empty directory), so at every instant `final_dir` is either the old or the new
    complete checkpoint. A `tmp_dir` without DCP's `.metadata` is refused (CheckpointError), never
    given the final name: its save did not finish, or something else removed its files.
    """
    if not (tmp_dir / DCP_METADATA_FILE).is_file():
        raise CheckpointError(f"checkpoint '{final_dir}' could not be committed: its temporary directory "
                              f"'{tmp_dir}' has no DCP {DCP_METADATA_FILE} (the save did not finish, or another "
                              "process removed it)")
    atomic_write_json(tmp_dir / META_FILE, {"format": FORMAT, "format_version": FORMAT_VERSION, **meta})
    old = final_dir.with_name(final_dir.name + ".old")
    if final_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        final_dir.rename(old)
    tmp_dir.rename(final_dir)
    if old.exists():
        shutil.rmtree(old)


def delete_checkpoint(path: Path) -> None:
    # Rename first so a crash mid-delete leaves an ignored `.old`, not a broken checkpoint.
    trash = path.with_name(path.name + ".old")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def move_aside(path: Path) -> Path:
    """Move the checkpoint directory `path` into `abandoned/` next to it (a name taken by an
    earlier one gets `.2`, `.3`, ...); returns where it went."""
    into = path.parent / ABANDONED_DIR
    into.mkdir(exist_ok=True)
    target, n = into / path.name, 1
    while target.exists():
        n += 1
        target = into / f"{path.name}.{n}"
    path.rename(target)
    return target


def apply_retention(checkpoints_dir: Path, keep: int, protect: frozenset[Path] = frozenset(),
                    is_sound: Callable[[Path], bool] = lambda path: True) -> list[Path]:
    """Delete all but the newest `keep` sound complete checkpoints, and never those in `protect`
    (the ones a rollback may need); returns the deleted ones. Damaged ones (`is_sound` false)
    neither count towards `keep` nor are deleted: counting them could delete the newest checkpoint
    a resume can load, and a person may want to look at them (`ckpt verify` names them)."""
    sound = [path for _, path in list_checkpoints(checkpoints_dir) if is_sound(path)]
    doomed = [path for path in sound[:-keep] if path not in protect] if keep > 0 else []
    for path in doomed:
        delete_checkpoint(path)
    return doomed


def _holds_dcp_files(path: Path) -> bool:
    """Whether a directory holds what a save writes before meta.json (so lacking meta.json, it is
    an interrupted save rather than some other directory)."""
    return (path / DCP_METADATA_FILE).is_file() or any(path.glob(f"*{DCP_DATA_SUFFIX}"))


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's `meta.json`, or a CheckpointError saying why it is not a checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' is a file, not a checkpoint directory")
    if path.suffix == ".tmp":
        raise CheckpointError(f"checkpoint '{path}' is an unfinished save (its name ends in .tmp); "
                              "use a complete checkpoint")
    meta_file = path / META_FILE
    if not meta_file.is_file() and not _holds_dcp_files(path):
        raise CheckpointError(f"'{path}' is not a checkpoint directory: it holds no {META_FILE}, "
                              f"{DCP_METADATA_FILE} or {DCP_DATA_SUFFIX} files; pass a checkpoint "
                              "(RUN_DIR/checkpoints/step_XXXXXXXX, or one import-hf wrote)")
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint '{path}' is incomplete: it has no {META_FILE} "
                              "(the save was interrupted); use another checkpoint")
    meta = read_json_object(meta_file, CheckpointError, f"the {META_FILE} of checkpoint '{path}'")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a trinity-train checkpoint ({META_FILE} lacks format={FORMAT!r})")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint '{path}' has format version {meta.get('format_version')}, "
                              f"this trinity-train reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    if not (path / DCP_METADATA_FILE).is_file():
        raise CheckpointError(f"checkpoint '{path}' is incomplete: the DCP {DCP_METADATA_FILE} file is missing")
    return meta
