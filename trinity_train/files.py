"""Files that are either complete or absent, and JSON read back with one clear error.

Every file trinity-train writes whole (configs, manifests, ledgers, meta.json, reports) goes
through `atomic_write*`: the bytes go to a hidden temporary sibling, are flushed to disk, and the
sibling is renamed over the target, so a reader (or a crash) sees the old file or the new one,
never half of one. A failed write (a full disk, a read-only directory) removes its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from trinity_train.errors import ArgumentError, UserError


def user_path(text: str | Path) -> Path:
    """A path the user typed, `~` expanded (the shell leaves the `~` of `--out=~/x` alone, and a
    directory literally named `~` is a trap)."""
    return Path(text).expanduser()


def _first_existing(path: Path) -> Path | None:
    return next((p for p in (path, *path.parents) if p.exists()), None)


def output_directory(path: str | Path, option: str, new: bool = False) -> Path:
    """The directory an `option` of a command writes into, `~` expanded; ArgumentError (exit 2)
    when a file stands at it or above it, or (`new`) when it is a directory that is not empty."""
    path = user_path(path)
    existing = _first_existing(path)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: '{existing}' is a file"
        raise ArgumentError(f"{option} '{path}' {where}; give a directory (it is created if missing)")
    if new and path.is_dir() and any(path.iterdir()):
        raise ArgumentError(f"{option} '{path}' is a directory that is not empty; give a new directory "
                            "or remove that one")
    return path


def output_file(path: str | Path, option: str, example_name: str) -> Path:
    """The file an `option` of a command writes, `~` expanded; ArgumentError (exit 2) when it is a
    directory or a file stands where its directory would be made."""
    path = user_path(path)
    if path.is_dir():
        raise ArgumentError(f"{option} '{path}' is a directory: give the file to write, e.g. "
                            f"{option} {path / example_name}")
    existing = _first_existing(path.parent)
    if existing is not None and not existing.is_dir():
        raise ArgumentError(f"{option} '{path}' cannot be created: '{existing}' is a file; choose another {option}")
    return path


def temp_sibling(path: Path) -> Path:
    """A hidden name next to `path`, unique to this process, that readers never mistake for it."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; on a clean exit it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def append_line(path: str | Path, line: str) -> None:
    """Append `line` (one line, newline added) to `path` in one write with O_APPEND: the whole line
    lands after whatever any other process appended, never inside another's line (how a rank other
    than the recorder's adds an event to events.jsonl)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


def read_json_object(path: str | Path, error: type[UserError], what: str = "") -> dict:
    """The JSON object stored at `path`; `error` (naming the file and `what` it should be) when the
    file is missing, unreadable, not JSON, or holds something other than an object."""
    path = Path(path)
    label = f"{what} '{path}'" if what else f"'{path}'"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{label} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{label} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{label} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{label} must hold a JSON object, not a {type(value).__name__}")
    return value


def read_jsonl(path: str | Path) -> list[dict]:
    """Every complete JSON object of a JSON-lines file (a torn or garbled line is skipped); [] when
    the file does not exist."""
    records = []
    path = Path(path)
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    return records


# ---------------------------------------------------------------------------- disks

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_ALMOST_FULL = 1 << 20  # bytes: a write that failed on a disk with less than this free ran out of space


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def disk_problem(codes: set[int], path: str | Path, almost_full_counts: bool = False,
                 elsewhere: str = "--run.dir") -> str | None:
    """What the disk holding `path` did wrong, given the errno codes of a failed write to it:
    'no space left on ...' (with the free space and what to do) or 'cannot be written ...', or
    None when the codes say neither. `almost_full_counts`: a failure on a disk with (next to) no
    free space is a full disk whatever the codes say (torch's serializer reports ENOSPC as
    "unexpected pos"). `elsewhere` is the option that puts the file on another disk."""
    path = Path(path)
    where = f"the disk holding '{path.parent if path.suffix or not path.is_dir() else path}'"
    free = free_bytes(path)
    if codes & NO_SPACE or (almost_full_counts and free is not None and free < _ALMOST_FULL):
        left = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        if elsewhere != "--run.dir":
            return f"no space left on {where}{left}; free some space or choose another {elsewhere}"
        return (f"no space left on {where}{left}; free some space (or lower checkpoint.keep, or put run.dir "
                "on a larger disk) and continue with --checkpoint.resume=auto")
    if codes & NOT_WRITABLE:
        return f"{where} cannot be written (a read-only file system or no permission); choose another {elsewhere}"
    return None


def os_error_message(error: OSError) -> str | None:
    """One line for a failed write that is the disk's doing (full, read-only), else None."""
    path = error.filename or "."
    problem = disk_problem({error.errno} if error.errno is not None else set(), path)
    return f"could not write '{path}': {problem}" if problem else None
