"""Training checkpoints of a run: periodic (optionally asynchronous) saves, retention, resume.

`state` is a dict of `Stateful` components (model, optim, scheduler, loader, trainer, rng, ...);
a checkpoint is exactly that dict written by DCP, plus `meta.json` (step, resolved config, the
component names) committed last. Only one asynchronous save is in flight at a time: the next
save, or `wait()`, finishes the previous one (meta.json, rename, retention).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.compat import check_model_compatible, config_from_meta
from trinity_train.checkpoint.layout import (
    apply_retention,
    barrier,
    commit,
    delete_checkpoint,
    is_coordinator,
    list_checkpoints,
    newest_checkpoint,
    read_meta,
    remove_incomplete,
    step_dir_name,
)
from trinity_train.checkpoint.verify import verify_checkpoint
from trinity_train.config import CheckpointConfig, Config, config_to_dict
from trinity_train.errors import CheckpointError
from trinity_train.rundir import RunDir


@dataclass
class _PendingSave:
    future: Future
    tmp_dir: Path
    final_dir: Path
    meta: dict


def checkpoint_meta(kind: str, step: int, cfg: Config, components: list[str], **extra: Any) -> dict:
    return {
        "kind": kind,  # "training" (resumable) or "model" (weights only)
        "step": step,
        "components": sorted(components),
        "config": config_to_dict(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def write_checkpoint(state: dict[str, Any], final_dir: Path, meta: dict) -> None:
    """Synchronously write `state` to `final_dir` atomically (temp dir, meta.json, rename)."""
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    _prepare_tmp_dir(tmp_dir)
    dcp_io.save(state, tmp_dir)
    _commit_everywhere(tmp_dir, final_dir, meta)


def _prepare_tmp_dir(tmp_dir: Path) -> None:
    if is_coordinator():
        if tmp_dir.exists():  # left by an interrupted save of the same step
            shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(parents=True, exist_ok=True)
    barrier()


def _commit_everywhere(tmp_dir: Path, final_dir: Path, meta: dict) -> None:
    barrier()  # every rank has finished writing its shards
    if is_coordinator():
        commit(tmp_dir, final_dir, meta)
    barrier()


def read_compatible_meta(path: Path, cfg: Config) -> dict:
    """The meta of a complete checkpoint whose model is the one `cfg` describes."""
    meta = read_meta(path)
    check_model_compatible(config_from_meta(meta, path), cfg, path)
    return meta


def load_checkpoint(path: Path, state: dict[str, Any], cfg: Config) -> dict:
    """Restore `state` from the checkpoint at `path`; returns its meta. Checks fit first."""
    path = Path(path)
    meta = read_compatible_meta(path, cfg)
    missing = sorted(set(state) - set(meta.get("components", [])))
    if missing:
        hint = (" It holds model weights only: start a run from it with --checkpoint.init_from"
                if meta.get("kind") == "model" else "")
        raise CheckpointError(f"checkpoint '{path}' lacks {', '.join(missing)} needed to resume.{hint}")
    dcp_io.load(state, path)
    return meta


class CheckpointManager:
    def __init__(self, run_dir: Path, ckpt_cfg: CheckpointConfig, protect_lookback: int | None = None):
        """`protect_lookback`: retention keeps, besides the newest `keep`, the newest checkpoint at
        least this many steps older than the latest save (the one a rollback would restore) and
        the ones younger than that (the targets of later rollbacks)."""
        self.checkpoints_dir = RunDir(run_dir).checkpoints
        self.cfg = ckpt_cfg
        self.protect_lookback = protect_lookback
        self._pending: _PendingSave | None = None

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        return list_checkpoints(self.checkpoints_dir)

    def check(self, path: Path) -> None:
        """Raise CheckpointError unless `path` is complete and every item reads back."""
        verify_checkpoint(path)

    def discard_after(self, step: int) -> list[Path]:
        """Delete the complete checkpoints of steps after `step` (a timeline a rollback undid)."""
        doomed = [path for s, path in self.list() if s > step]
        if is_coordinator():
            for path in doomed:
                delete_checkpoint(path)
        barrier()
        return doomed

    def remove_interrupted_saves(self) -> list[Path]:
        removed = remove_incomplete(self.checkpoints_dir) if is_coordinator() else []
        barrier()
        return removed

    def is_due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def resume_path(self) -> Path | None:
        """The checkpoint `checkpoint.resume` selects, or None to start fresh."""
        resume = self.cfg.resume
        if resume == "none":
            return None
        if resume == "auto":
            return newest_checkpoint(self.checkpoints_dir)
        path = Path(resume)
        read_meta(path)  # a named checkpoint must exist and be complete
        return path

    def save(self, step: int, state: dict[str, Any], cfg: Config, **extra_meta: Any) -> Path:
        """Save `state` as checkpoint `step`; returns the directory it will have once complete."""
        self.wait()
        final_dir = self.checkpoints_dir / step_dir_name(step)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        meta = checkpoint_meta("training", step, cfg, list(state), **extra_meta)
        if self.cfg.async_save:
            _prepare_tmp_dir(tmp_dir)
            self._pending = _PendingSave(dcp_io.async_save(state, tmp_dir), tmp_dir, final_dir, meta)
        else:
            write_checkpoint(state, final_dir, meta)
            self._after_commit(step)
        return final_dir

    def wait(self) -> Path | None:
        """Finish an in-flight asynchronous save; returns its directory, if there was one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.future.result()
        _commit_everywhere(pending.tmp_dir, pending.final_dir, pending.meta)
        self._after_commit(pending.meta["step"])
        return pending.final_dir

    def _rollback_candidates(self, step: int) -> frozenset[Path]:
        """What a rollback may need from now on: the newest checkpoint at least `protect_lookback`
        steps before `step`, and the younger ones, which become that as training goes on."""
        if self.protect_lookback is None:
            return frozenset()
        horizon = step - self.protect_lookback
        found = self.list()
        old_enough = [path for s, path in found if s <= horizon]
        return frozenset(old_enough[-1:] + [path for s, path in found if s > horizon])

    def _after_commit(self, step: int) -> None:
        if is_coordinator():
            apply_retention(self.checkpoints_dir, self.cfg.keep, protect=self._rollback_candidates(step))
        barrier()
