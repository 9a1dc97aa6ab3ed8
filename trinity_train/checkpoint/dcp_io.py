"""Thin wrappers over `torch.distributed.checkpoint` save/load for one or many processes.

DCP works in a single process without a process group (`no_dist`), and warns that it is doing
so, also from the thread of an asynchronous save; that is our intended single-process mode, so
that one warning is filtered out. Load failures (missing keys, shape mismatches, unreadable files) become a CheckpointError that
names the checkpoint and the first reason DCP gave.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trinity_train.errors import CheckpointError

def _no_dist() -> bool:
    # Installed on every call (not once at import), so it also holds where the filter list was
    # reset since; filters are process-wide, so it covers the asynchronous save's thread too.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)
    return not dist.is_initialized()


def save(state: dict[str, Any], path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=_no_dist())


_async_group = None


def _async_process_group():
    """A gloo group for the background save's collectives, so they never interleave with the
    training collectives on the default (e.g. NCCL) group. Created on first use, which every rank
    reaches at the same save."""
    global _async_group
    if _async_group is None and dist.is_initialized():
        _async_group = dist.new_group(backend="gloo")
    return _async_group


def async_save(state: dict[str, Any], path: Path) -> Future:
    """Starts writing after staging a copy of `state`, so training may change it right away."""
    return dcp.async_save(state, checkpoint_id=str(path), no_dist=_no_dist(), process_group=_async_process_group())


def _first_failure(error: CheckpointException) -> str:
    for failure in error.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return str(exc) or type(exc).__name__
    return str(error)


def load(state: dict[str, Any], path: Path) -> None:
    """Load `path` into `state` in place (Stateful values get `load_state_dict` afterwards)."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    except CheckpointException as e:
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {_first_failure(e)}") from None
    except (OSError, EOFError, RuntimeError, ValueError, KeyError) as e:
        # Truncated or corrupt files surface as these from the reader or from unpickling.
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {type(e).__name__}: {e}") from None
