"""What a checksum of every checkpoint file costs, against the save itself.

    python benchmarks/checkpoint_hash.py [--config FILE] [--repeats N] [--section.key=value ...]

Saves the training state of the config's model (default: configs/debug.toml; weights plus Muon
and AdamW state after one step) with the trainer's own CheckpointManager, then hashes the
checkpoint's files with each candidate, alternating candidates and saves, best of `--repeats`.
The files are in the page cache when they are hashed, as they are right after a save. Prints the
throughput of each hash and its cost as a fraction of the save time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from trinity_harness.jobs import loadavg  # noqa: E402
from trinity_harness.table import markdown_table  # noqa: E402
from trinity_train.checkpoint import CheckpointManager, ModelState, OptimizerState  # noqa: E402
from trinity_train.config import default_config_path, load_config  # noqa: E402
from trinity_train.model import build_model  # noqa: E402
from trinity_train.optim.groups import build_optimizer  # noqa: E402

CHUNK = 1 << 22


def _hashlib(name):
    return lambda: hashlib.new(name)


def candidates() -> dict:
    found = {"sha256": _hashlib("sha256"), "blake2b": _hashlib("blake2b")}
    try:
        import xxhash

        found.update(xxh3_64=xxhash.xxh3_64, xxh3_128=xxhash.xxh3_128)
    except ImportError:
        pass
    try:
        import blake3

        found["blake3"] = blake3.blake3
    except ImportError:
        pass
    return found


def hash_files(files: list[Path], new) -> None:
    for path in files:
        h = new()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        h.hexdigest()


def trained_state(cfg):
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--repeats", type=int, default=5)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config or default_config_path(), overrides)
    state = trained_state(cfg)
    hashes = candidates()
    saves, costs = [], {name: [] for name in hashes}
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Path(tmp), cfg.checkpoint)
        for step in range(1, args.repeats + 1):
            started = time.perf_counter()
            path = manager.save(step, state, cfg)
            saves.append(time.perf_counter() - started)
            files = sorted(f for f in path.iterdir() if f.is_file())
            for name, new in hashes.items():
                started = time.perf_counter()
                hash_files(files, new)
                costs[name].append(time.perf_counter() - started)
        size = sum(f.stat().st_size for f in files)
    print(f"# load: {loadavg()}")
    print(f"checkpoint: {len(files)} files, {size / 1e6:.1f} MB; save (sync, DCP, incl. fsync) best "
          f"{min(saves):.3f} s, median {statistics.median(saves):.3f} s")
    print(markdown_table(["hash", "best s", "MB/s", "of the save time"],
                         [[name, f"{min(seconds):.4f}", f"{size / 1e6 / min(seconds):,.0f}",
                           f"{100 * min(seconds) / min(saves):.1f} %"]
                          for name, seconds in sorted(costs.items(), key=lambda kv: min(kv[1]))]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
