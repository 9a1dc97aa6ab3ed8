"""Run `trinity-train` and kill it (SIGKILL, as the OOM killer or a preempted node would) at one
moment of saving the checkpoint of step KILL_STEP:

    python tests/kill_at.py MOMENT KILL_STEP train [--config FILE] [--key=value ...]

MOMENT is where in the save the process dies:
  write      halfway through writing a DCP data file (the background thread of an async save)
  checksums  the data is written, meta.json not yet (sync) / the write is done, not yet committed (async)
  rename     meta.json is written into the temporary directory, which is not renamed yet
  retention  the checkpoint is complete under its final name; older ones not yet pruned
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from trinity_train import cli
from trinity_train.checkpoint import layout, manager


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(moment: str, step: int, argv: list[str]) -> int:
    target = layout.step_dir_name(step)

    def ours(path) -> bool:
        return target in str(path)

    if moment == "write":
        create_stream = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def half_written(self, path, mode):
            with create_stream(self, path, mode) as stream:
                if ours(path) and str(path).endswith(".distcp"):
                    write = stream.write

                    def write_half_then_die(data):
                        write(bytes(data)[: len(data) // 2])
                        stream.flush()
                        die()

                    stream.write = write_half_then_die
                yield stream

        filesystem.FileSystem.create_stream = half_written
    elif moment == "checksums":
        commit_everywhere = manager._commit_everywhere

        def before_commit(tmp_dir, *args, **kwargs):
            if ours(tmp_dir):
                die()
            return commit_everywhere(tmp_dir, *args, **kwargs)

        manager._commit_everywhere = before_commit
    elif moment == "rename":
        write_json = layout.atomic_write_json

        def meta_then_die(path, obj):
            write_json(path, obj)
            if ours(path):
                die()

        layout.atomic_write_json = meta_then_die
    elif moment == "retention":
        retention = manager.apply_retention

        def complete_then_die(checkpoints_dir: Path, *args, **kwargs):
            if (checkpoints_dir / target).is_dir():
                die()
            return retention(checkpoints_dir, *args, **kwargs)

        manager.apply_retention = complete_then_die
    else:
        raise SystemExit(f"unknown moment {moment!r}")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
