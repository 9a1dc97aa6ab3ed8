"""Thin wrappers over `torch.distributed.checkpoint` save/load for one or many processes.

DCP works in a single process without a process group (`no_dist`), and warns that it is doing
so, also from the thread of an asynchronous save; that is our intended single-process mode, so
that one warning is filtered out. Load failures (missing keys, shape mismatches, unreadable files)
become a CheckpointError that names the checkpoint and the first reason DCP gave; save failures
one that names the disk when it is full or read-only.

Two side groups (gloo, created on the first save, which every rank reaches together) keep the
checkpoint's own collectives off the training group: one for the background writes of an
asynchronous save, one for committing (agreeing that every rank's write finished, gathering the
checksums), which runs on the training thread while a background write may still use the first.
"""

from __future__ import annotations

import datetime
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageWriter

from trinity_train.errors import CheckpointError
from trinity_train.files import disk_problem


def _no_dist() -> bool:
    # Installed on every call (not once at import), so it also holds where the filter list was
    # reset since; filters are process-wide, so it covers the asynchronous save's thread too.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)
    return not dist.is_initialized()


# ---------------------------------------------------------------------------- failures


def _causes(error: BaseException):
    """`error`, its causes and contexts, and the per-rank failures of a CheckpointException."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _first_failure(error: CheckpointException) -> str:
    for failure in error.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return str(exc) or type(exc).__name__
    return str(error)


def save_failure(error: BaseException, path: Path) -> CheckpointError:
    """The one-line error of a save of `path` that failed with `error`."""
    if isinstance(error, CheckpointError):
        return error
    codes = {e.errno for e in _causes(error) if isinstance(e, OSError) and e.errno is not None}
    reason = disk_problem(codes, path, almost_full_counts=True)
    if reason is None:
        first = _first_failure(error) if isinstance(error, CheckpointException) else f"{type(error).__name__}: {error}"
        reason = first
    return CheckpointError(f"checkpoint '{path}' could not be written: {reason}")


# ---------------------------------------------------------------------------- saving


_groups: dict[str, tuple[Any, Any]] = {}  # name -> (the world group it belongs to, the group)


def side_group(name: str, timeout_s: float | None):
    """The gloo group `name` ("async" or "commit") of the current process group, created on first
    use (every rank reaches that together); None in one process. `timeout_s` is the job's
    collective timeout (None: torch's 30 minutes): required, because the first caller fixes it for
    the group's life, and a group made without it lets a frozen rank hang the others for 30 min."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if name not in _groups or _groups[name][0] is not world:  # none yet, or of an earlier group
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        _groups[name] = (world, dist.new_group(backend="gloo", timeout=timeout))
    return _groups[name][1]


def save(state: dict[str, Any], path: Path, storage_writer: StorageWriter | None = None) -> None:
    """Write `state` to `path` (collective); `storage_writer`: DCP's writer for it (None: its
    file-system writer)."""
    try:
        dcp.save(state, checkpoint_id=str(path), storage_writer=storage_writer, no_dist=_no_dist())
    except (Exception, CheckpointException) as e:  # (a BaseException) every failure: one line naming it
        raise save_failure(e, path) from None


def async_save(state: dict[str, Any], path: Path, timeout_s: float | None,
               storage_writer: StorageWriter | None = None) -> Future:
    """Starts writing after staging a copy of `state`, so training may change it right away."""
    try:
        return dcp.async_save(state, checkpoint_id=str(path), storage_writer=storage_writer, no_dist=_no_dist(),
                              process_group=side_group("async", timeout_s))
    except (Exception, CheckpointException) as e:
        raise save_failure(e, path) from None


def everyone(flag: bool, timeout_s: float | None) -> bool:
    """Whether `flag` holds on every rank (a collective on the commit group)."""
    group = side_group("commit", timeout_s)
    if group is None:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def gather_from_everyone(value: Any, timeout_s: float | None) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    group = side_group("commit", timeout_s)
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


# ---------------------------------------------------------------------------- loading


def load(state: dict[str, Any], path: Path) -> None:
    """Load `path` into `state` in place (Stateful values get `load_state_dict` afterwards)."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    except CheckpointException as e:
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {_first_failure(e)}") from None
    except (OSError, EOFError, RuntimeError, ValueError, KeyError) as e:
        # Truncated or corrupt files surface as these from the reader or from unpickling.
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {type(e).__name__}: {e}") from None


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
