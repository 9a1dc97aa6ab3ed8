"""Training checkpoints of a run: periodic (optionally asynchronous) saves, retention, resume.

`state` is a dict of `Stateful` components (model, optim, scheduler, loader, trainer, rng, ...);
a checkpoint is exactly that dict written by DCP, plus `meta.json` (step, resolved config, the
component names, every file's checksum) committed last.

An asynchronous save is committed as soon as its write has finished: `poll()`, called once per
training step, commits it when every rank's write (and its checksums, computed in the background
too) is done, so a crash loses at most the steps since the last checkpoint interval. Only one
save is in flight at a time: the next save, or `wait()`, finishes the previous one first. Whoever
saves can pass `on_commit(path)`, called once the checkpoint is complete under its final name.

Which checkpoint a resume loads is decided by rank 0 and given to every rank: the newest one
that passes `check_integrity` (`resume = "auto"`, and after a torchrun restart; the damaged ones
it passes over are kept in `passed_over` for the run to log), or the named one, refused with the
newest sound alternative when it is damaged. The start then moves the run's checkpoints of later
steps into `checkpoints/abandoned/` (`abandon_after`), so that only the timeline it continues is
ever resumed; retention counts and deletes only sound checkpoints.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch.distributed.checkpoint.storage import StorageWriter

from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.compat import check_model_compatible, config_from_meta
from trinity_train.checkpoint.integrity import (SoundnessCache, candidate_checkpoints, check_integrity,
                                                digest_files, find_sound_checkpoint, newest_sound_checkpoint,
                                                require_sound)
from trinity_train.checkpoint.layout import (
    apply_retention,
    commit,
    delete_checkpoint,
    list_checkpoints,
    move_aside,
    read_meta,
    remove_incomplete,
    step_dir_name,
)
from trinity_train.config import CheckpointConfig, Config, config_to_dict
from trinity_train.errors import CheckpointError
from trinity_train.rank_zero import barrier, decided_by_rank_zero, is_coordinator
from trinity_train.rundir import RunDir

OnCommit = Callable[[Path], None]
# The storage writer of a save into a directory, or None for DCP's own: where a drill (or another
# storage) plugs into every save at once (`CheckpointManager.storage_writer`).
StorageWriters = Callable[[Path], StorageWriter | None]


def torchrun_restart_count() -> int:
    """How often torchrun has restarted this process's workers (0 on the first start or without
    torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


@dataclass
class _PendingSave:
    digests: Future  # this rank's file checksums, once its write has finished
    tmp_dir: Path
    final_dir: Path
    meta: dict
    on_commit: OnCommit | None


def checkpoint_meta(kind: str, step: int, cfg: Config, components: list[str], **extra: Any) -> dict:
    return {
        "kind": kind,  # "training" (resumable) or "model" (weights only)
        "step": step,
        "components": sorted(components),
        "config": config_to_dict(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def _timeout_s(cfg: Config | None) -> float | None:
    return cfg.parallel.collective_timeout_s if cfg is not None else None


def write_checkpoint(state: dict[str, Any], final_dir: Path, meta: dict, cfg: Config | None = None,
                     storage_writer: StorageWriters | None = None) -> None:
    """Synchronously write `state` to `final_dir` atomically (temp dir, meta.json, rename);
    `storage_writer(tmp_dir)` gives DCP's writer (None: its own)."""
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    _prepare_tmp_dir(tmp_dir)
    try:
        dcp_io.save(state, tmp_dir, storage_writer(tmp_dir) if storage_writer else None)
        digests = _own_digests(tmp_dir)
    except CheckpointError as e:
        digests = e
    _commit_everywhere(tmp_dir, final_dir, meta, digests, _timeout_s(cfg))


def _prepare_tmp_dir(tmp_dir: Path) -> None:
    if is_coordinator():
        try:
            if tmp_dir.exists():  # left by an interrupted save of the same step
                shutil.rmtree(tmp_dir)
            tmp_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise dcp_io.save_failure(e, tmp_dir) from None
    barrier()


def _own_digests(tmp_dir: Path) -> dict:
    rank, world = dcp_io.rank_and_world()
    try:
        return digest_files(tmp_dir, rank, world)
    except OSError as e:
        raise dcp_io.save_failure(e, tmp_dir) from None


def _commit_everywhere(tmp_dir: Path, final_dir: Path, meta: dict, digests: dict | CheckpointError,
                       timeout_s: float | None) -> None:
    """Gather every rank's checksums (or failure), then the coordinator writes meta.json and
    renames; a failure anywhere (the commit's included) removes the temporary directory and raises
    on every rank."""
    gathered = dcp_io.gather_from_everyone(digests if isinstance(digests, dict) else str(digests), timeout_s)
    failures = [g for g in gathered if not isinstance(g, dict)]
    if failures:
        if is_coordinator():
            shutil.rmtree(tmp_dir, ignore_errors=True)
        barrier()
        raise CheckpointError(failures[0])
    files = {name: record for part in gathered for name, record in part.items()}
    decided_by_rank_zero(lambda: _commit_or_clean_up(tmp_dir, final_dir, {**meta, "files": files}))


def _commit_or_clean_up(tmp_dir: Path, final_dir: Path, meta: dict) -> None:
    try:
        commit(tmp_dir, final_dir, meta)
    except (OSError, CheckpointError) as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise dcp_io.save_failure(e, final_dir) from None


def read_compatible_meta(path: Path, cfg: Config) -> dict:
    """The meta of a complete checkpoint whose model is the one `cfg` describes."""
    meta = read_meta(path)
    check_model_compatible(config_from_meta(meta, path), cfg, path)
    return meta


def load_checkpoint(path: Path, state: dict[str, Any], cfg: Config) -> dict:
    """Restore `state` from the checkpoint at `path` (a resume, a rollback, `init_from`); returns
    its meta. Checks that it is whole (`require_sound`) and fits first."""
    path = Path(path)
    require_sound(path)
    meta = read_compatible_meta(path, cfg)
    missing = sorted(set(state) - set(meta.get("components", [])))
    if missing:
        hint = (" It holds model weights only: start a run from it with --checkpoint.init_from"
                if meta.get("kind") == "model" else "")
        raise CheckpointError(f"checkpoint '{path}' lacks {', '.join(missing)} needed to resume.{hint}")
    dcp_io.load(state, path)
    return meta


def _digests_when_written(written: Future, tmp_dir: Path) -> Future:
    """A future of this rank's checksums, computed in the writer's thread once `written` is done."""
    digests: Future = Future()
    rank, world = dcp_io.rank_and_world()

    def hash_files(done: Future) -> None:
        try:
            done.result()
            digests.set_result(digest_files(tmp_dir, rank, world))
        except BaseException as e:  # reported on the training thread, at commit
            digests.set_exception(dcp_io.save_failure(e, tmp_dir))

    written.add_done_callback(hash_files)
    return digests


class CheckpointManager:
    def __init__(self, run_dir: Path, ckpt_cfg: CheckpointConfig, protect_lookback: int | None = None,
                 collective_timeout_s: float | None = None):
        """`protect_lookback`: retention keeps, besides the newest `keep`, the newest checkpoint at
        least this many steps older than the latest save (the one a rollback would restore) and
        the ones younger than that (the targets of later rollbacks). `collective_timeout_s`
        (parallel.collective_timeout_s) bounds every collective of the checkpoint's side groups."""
        self.checkpoints_dir = RunDir(run_dir).checkpoints
        self.cfg = ckpt_cfg
        self.protect_lookback = protect_lookback
        self._pending: _PendingSave | None = None
        self._timeout_s = collective_timeout_s
        # (path, reason) of each damaged checkpoint `resume_path` passed over, newest first.
        self.passed_over: list[tuple[Path, str]] = []
        self._soundness = SoundnessCache()
        self.saving_step: int | None = None  # the step of the latest save begun
        self.storage_writer: StorageWriters = lambda path: None  # DCP's own; a drill's fails (stability.drills)

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        return list_checkpoints(self.checkpoints_dir)

    def discard_after(self, step: int) -> list[Path]:
        """Delete the complete checkpoints of steps after `step` (a timeline a rollback undid)."""
        doomed = [path for s, path in self.list() if s > step]
        if is_coordinator():
            for path in doomed:
                delete_checkpoint(path)
        barrier()
        return doomed

    def abandon_after(self, step: int, resumed: Path | None) -> list[tuple[Path, Path]]:
        """Move aside (into `checkpoints/abandoned/`) every checkpoint of this run that a run
        starting at `step` from `resumed` (None: from scratch) does not continue: those of later
        steps, sound or damaged, and one of `step` that is not `resumed`. Otherwise the next
        `resume = auto` (and every torchrun restart) would pick the future the user left behind,
        and retention would count it. Collective: rank 0 moves, every rank gets the
        (from, to) moves."""
        return decided_by_rank_zero(lambda: self._move_aside_after(step, resumed))

    def _move_aside_after(self, step: int, resumed: Path | None) -> list[tuple[Path, Path]]:
        stale = [path for s, path in candidate_checkpoints(self.checkpoints_dir)
                 if s > step or (s == step and (resumed is None or path.resolve() != resumed.resolve()))]
        try:
            moves = [(path, move_aside(path)) for path in stale]
        except OSError as e:
            raise CheckpointError(f"could not move the checkpoints after step {step} aside: {e}") from None
        if moves:
            print(f"warning: starting at step {step} abandons the run's later checkpoints "
                  f"({', '.join(p.name for p, _ in moves)}): moved to {moves[0][1].parent}, where no resume "
                  "picks them", file=sys.stderr)
        return moves

    def remove_interrupted_saves(self) -> list[Path]:
        removed = remove_incomplete(self.checkpoints_dir) if is_coordinator() else []
        barrier()
        return removed

    def is_due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def resume_path(self) -> Path | None:
        """The checkpoint `checkpoint.resume` selects, or None to start fresh (collective: rank 0
        decides). After a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0 on any rank; torchrun
        counts per node) the newest sound checkpoint of the run wins over `checkpoint.resume`, so
        a restarted job continues where it got to instead of starting over."""
        restarted = max(dcp_io.gather_from_everyone(torchrun_restart_count(), self._timeout_s)) > 0
        path, self.passed_over = decided_by_rank_zero(lambda: self._select(restarted))
        return path

    def _select(self, restarted: bool) -> tuple[Path | None, list[tuple[Path, str]]]:
        resume = self.cfg.resume
        if restarted and resume != "auto" and candidate_checkpoints(self.checkpoints_dir):
            resume = "auto"
        if resume == "none":
            return None, []
        if resume == "auto":
            path, passed_over = newest_sound_checkpoint(self.checkpoints_dir)
            if path is None and passed_over:
                raise CheckpointError(f"no checkpoint of '{self.checkpoints_dir}' can be resumed: all "
                                      f"{len(passed_over)} are damaged (the newest: {passed_over[0][1]}); start a "
                                      "new run with another --run.dir or --checkpoint.resume=none")
            return path, passed_over
        return self._checked(Path(resume)), []

    def _checked(self, path: Path) -> Path:
        """`path` if it passes the integrity check, else an error naming the newest that does."""
        try:
            check_integrity(path)
        except CheckpointError as e:
            alternative = None
            for near in dict.fromkeys((path.parent, self.checkpoints_dir)):
                alternative = alternative or newest_sound_checkpoint(near)[0]
            hint = (f"the newest checkpoint that verifies is '{alternative}': resume from it with "
                    f"--checkpoint.resume={alternative} (or --checkpoint.resume=auto)" if alternative is not None
                    else "no other checkpoint there verifies")
            raise CheckpointError(f"{e}; {hint}") from None
        return path

    def save(self, step: int, state: dict[str, Any], cfg: Config, on_commit: OnCommit | None = None,
             **extra_meta: Any) -> Path:
        """Save `state` as checkpoint `step`; returns the directory it will have once complete.
        `on_commit(path)` runs when it is (at once for a synchronous save). A failed save raises
        CheckpointError on every rank (here, or from `poll`/`wait` for an asynchronous one) and
        leaves no directory behind. Each rank writes with `storage_writer`."""
        self.wait()
        self.saving_step = step
        self._timeout_s = _timeout_s(cfg)
        final_dir = self.checkpoints_dir / step_dir_name(step)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        meta = checkpoint_meta("training", step, cfg, list(state), **extra_meta)
        if self.cfg.async_save:
            _prepare_tmp_dir(tmp_dir)
            written = dcp_io.async_save(state, tmp_dir, self._timeout_s, self.storage_writer(tmp_dir))
            self._pending = _PendingSave(_digests_when_written(written, tmp_dir), tmp_dir, final_dir, meta,
                                         on_commit)
        else:
            write_checkpoint(state, final_dir, meta, cfg, self.storage_writer)
            self._after_commit(step, final_dir, on_commit)
        return final_dir

    @property
    def pending(self) -> bool:
        """An asynchronous save is in flight (`poll` and `wait` have work to do)."""
        return self._pending is not None

    def poll(self) -> Path | None:
        """Commit the asynchronous save in flight if every rank has finished writing it (collective
        while one is in flight); returns its directory when it was committed now."""
        if self._pending is None or not dcp_io.everyone(self._pending.digests.done(), self._timeout_s):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Finish an in-flight asynchronous save; returns its directory, if there was one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            digests: dict | CheckpointError = pending.digests.result()
        except CheckpointError as e:
            digests = e
        _commit_everywhere(pending.tmp_dir, pending.final_dir, pending.meta, digests, self._timeout_s)
        self._after_commit(pending.meta["step"], pending.final_dir, pending.on_commit)
        return pending.final_dir

    def rollback_target(self, max_step: int, on_passed_over: Callable[[Path, str], None]) -> Path | None:
        """The newest checkpoint at or before `max_step` that passes its integrity check (sizes and
        checksums), once an in-flight save (which may be it) is committed; damaged ones are passed
        to `on_passed_over(path, reason)` and never loaded. Collective: rank 0 decides for every rank."""
        self.wait()
        return find_sound_checkpoint(self.checkpoints_dir, max_step, on_passed_over=on_passed_over)

    def _rollback_candidates(self, step: int) -> frozenset[Path]:
        """What a rollback may need from now on: the newest checkpoint at least `protect_lookback`
        steps before `step`, and the younger ones, which become that as training goes on."""
        if self.protect_lookback is None:
            return frozenset()
        horizon = step - self.protect_lookback
        found = self.list()
        old_enough = [path for s, path in found if s <= horizon]
        return frozenset(old_enough[-1:] + [path for s, path in found if s > horizon])

    def _after_commit(self, step: int, final_dir: Path, on_commit: OnCommit | None) -> None:
        if is_coordinator():
            self._soundness.vouch(final_dir)
            apply_retention(self.checkpoints_dir, self.cfg.keep, protect=self._rollback_candidates(step),
                            is_sound=self._soundness.is_sound)
        barrier()
        if on_commit is not None:
            on_commit(final_dir)
