"""The loader at Trinity scale, rehearsed on sparse files: does its start-up, memory and batch time
stay flat from 1B to 15T tokens?

For each size it writes six prepared datasets (a web/code/math/books/papers/wiki mix with three
phases) whose token files are holes (`truncate`: apparent size 2 bytes a token, real disk use
~0), listed by real manifests (`shards.shard_record`, `split_summary`, `new_manifest`,
`write_manifest`, token-sized shards of `--shard-tokens`). Holes read as token 0, which the
manifests name the EOS id, so every document ends with EOS as the format requires; the `.idx`
files are real (`--docs-per-shard` seeded document ends each); the records' sha256 are those of
the files written. Then, in a fresh process per size, data-parallel rank 2047 of 2048:

- builds its loaders (`build_loaders`) twice: the first start hashes this rank's 1/2048 share of
  the shards (`data.verify_checksums = "stamp"`), the second finds them stamped;
- skips to batch 3,600,000 (~15T tokens at 2,048 x 2,048 tokens a batch) and times that batch and
  the next ones, and where every row of that global batch comes from (`row_origins`, all ranks);
- resumes: a new loader loads the state saved before that batch and must produce the same batch;
- reports its peak RSS (`getrusage`) and the bytes the sample order holds.

What it does not measure: disk reads. A hole is served from the page cache as zeros, so a row
costs what it costs on a warm cache; a cold read on a real file system adds its latency per row.

    python benchmarks/loader_at_scale.py [--sizes 1e9,1e11,1e12,1.5e13] [--dir /tmp]

The files are deleted at the end, also on failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trinity_harness.jobs import loadavg
from trinity_train.data.shards import (OFFSET_DTYPE, shard_paths, shard_record, split_summary, new_manifest,
                                       token_dtype_for, write_manifest)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"web": 0.35, "code": 0.25, "math": 0.15, "books": 0.10, "papers": 0.10, "wiki": 0.05}
# Later phases move weight to code and math (an anneal): (fraction of the run, weights).
PHASES = [(0.6, [0.25, 0.25, 0.2, 0.1, 0.1, 0.1]), (0.9, [0.1, 0.3, 0.3, 0.1, 0.1, 0.1])]
VOCAB = 65536  # uint16 ids
SEQ_LEN, DP_SIZE, DP_RANK = 2048, 2048, 2047
BATCH = 3_600_000  # global batches of 2,048 rows of 2,048 tokens: ~15.1T tokens
VAL_TOKENS = 1 << 24
BUILD_KEY = "loader-at-scale"
_ZERO = bytes(1 << 24)


class ZeroHashes:
    """sha256 of n zero bytes, computed once per n (all full shards share one)."""

    def __init__(self):
        self._known: dict[int, str] = {}

    def __call__(self, nbytes: int) -> str:
        if nbytes not in self._known:
            h = hashlib.sha256()
            for start in range(0, nbytes, len(_ZERO)):
                h.update(_ZERO[:min(len(_ZERO), nbytes - start)])
            self._known[nbytes] = h.hexdigest()
        return self._known[nbytes]


def write_sparse_dataset(path: Path, num_tokens: int, shard_tokens: int, docs_per_shard: int, seed: int,
                         zero_hashes: ZeroHashes, val_tokens: int = VAL_TOKENS) -> int:
    """A prepared dataset of `num_tokens` training tokens in hole-only token files; its shard count."""
    dtype = token_dtype_for(VOCAB)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, tokens in (("train", num_tokens), ("val", val_tokens)):
        sizes = [shard_tokens] * (tokens // shard_tokens) + ([tokens % shard_tokens] if tokens % shard_tokens else [])
        records = []
        for index, n in enumerate(sizes):
            bin_path, idx_path, _ = shard_paths(path / split, index)
            bin_path.parent.mkdir(parents=True, exist_ok=True)
            with open(bin_path, "wb") as f:
                f.truncate(n * dtype.itemsize)
            ends = np.unique(rng.integers(1, n, size=min(docs_per_shard, n) - 1)) if n > 1 else np.empty(0, np.int64)
            offsets = np.concatenate([[0], ends, [n]]).astype(OFFSET_DTYPE).tobytes()
            idx_path.write_bytes(offsets)
            records.append(shard_record(index, BUILD_KEY, n, len(offsets) // OFFSET_DTYPE.itemsize - 1, 0,
                                        tokens={"bytes": n * dtype.itemsize, "sha256": zero_hashes(n * dtype.itemsize)},
                                        offsets={"bytes": len(offsets), "sha256": hashlib.sha256(offsets).hexdigest()}))
        splits[split] = split_summary(records)
    tokenizer = {"file": "tokenizer.json", "sha256": BUILD_KEY, "vocab_size": VOCAB, "eos_token": "<eos>", "eos_id": 0}
    write_manifest(path, new_manifest(BUILD_KEY, tokenizer, dtype, splits, rehearsal=True))
    return len(splits["train"]["shards"]) + len(splits["val"]["shards"])


def source_tokens(total: int, shard_tokens: int) -> list[int]:
    """Each source's training tokens: its share of `total`, whole shards where it has more than one."""
    out = []
    for share in SOURCES.values():
        n = int(total * share)
        out.append(n - n % shard_tokens if n > shard_tokens else n)
    return out


def loader_config(dirs: list[Path], work: Path):
    from trinity_train.config import load_config
    run_tokens = BATCH * DP_SIZE * SEQ_LEN
    mix = [{"path": str(d), "weight": w} for d, w in zip(dirs, SOURCES.values())]
    phases = [{"start_tokens": int(run_tokens * at), "weights": w} for at, w in PHASES]
    return load_config(None, {
        "data": {"mix": mix, "phases": phases, "seq_len": SEQ_LEN, "cache_dir": str(work / "cache"),
                 "verify_checksums": "stamp"},
        "model": {"vocab_size": VOCAB}, "train": {"micro_batch_size": 1, "grad_accum": 1},
        "run": {"dir": str(work / "run")}})


def order_bytes(orders) -> int:
    """Bytes of the arrays the sample order holds (the round keys of its cached epochs)."""
    total = 0
    for order in orders:
        for cached in order._perms.values():
            total += sum(a.nbytes for a in vars(cached).values() if isinstance(a, np.ndarray))
    return total


def measure(dirs: list[Path], work: Path) -> dict:
    """Rank DP_RANK's start-ups, batch BATCH and a resume there (run in a fresh process)."""
    import torch
    from trinity_train.data import build_loaders
    cfg = loader_config(dirs, work)
    started = time.perf_counter()
    build_loaders(cfg, DP_RANK, DP_SIZE)
    first_start = time.perf_counter() - started
    started = time.perf_counter()
    train, _ = build_loaders(cfg, DP_RANK, DP_SIZE)
    start = time.perf_counter() - started
    train.skip(BATCH)
    state = train.state_dict()
    started = time.perf_counter()
    batch = train.next_batch()
    first_batch = time.perf_counter() - started
    times = []
    for _ in range(20):
        started = time.perf_counter()
        train.next_batch()
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    train.row_origins(BATCH)
    origins = time.perf_counter() - started
    resumed, _ = build_loaders(cfg, DP_RANK, DP_SIZE)
    resumed.load_state_dict(state)
    again = resumed.next_batch()
    same = again.index == batch.index == BATCH and all(
        torch.equal(getattr(batch, k), getattr(again, k)) for k in ("input_ids", "labels", "position_ids", "document_ids"))
    return {"first_start_s": first_start, "start_s": start, "first_batch_ms": first_batch * 1e3,
            "batch_ms": float(np.median(times)) * 1e3, "global_origins_ms": origins * 1e3, "resume_equal": same,
            "order_bytes": order_bytes(train._mixed.orders),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def disk_use(path: Path) -> tuple[int, int]:
    """(apparent bytes, bytes really allocated) under `path`."""
    apparent = real = 0
    for f in path.rglob("*"):
        if f.is_file():
            st = f.stat()
            apparent += st.st_size
            real += st.st_blocks * 512
    return apparent, real


def run_size(total: int, args, base: Path, zero_hashes: ZeroHashes) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"loader-at-scale-{total:.0e}-", dir=base))
    try:
        started = time.perf_counter()
        dirs, shards = [], 0
        for k, (name, tokens) in enumerate(zip(SOURCES, source_tokens(total, args.shard_tokens))):
            dirs.append(work / name)
            shards += write_sparse_dataset(dirs[-1], tokens, args.shard_tokens, args.docs_per_shard, k, zero_hashes)
        written = time.perf_counter() - started
        apparent, real = disk_use(work)
        manifests = sum((d / "manifest.json").stat().st_size for d in dirs)
        child = subprocess.run([sys.executable, __file__, "--measure", json.dumps([str(d) for d in dirs]),
                                "--work", str(work / "measure")], capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"measuring {total:.0e} tokens failed:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        return {"tokens": sum(source_tokens(total, args.shard_tokens)), "shards": shards,
                "manifest_mb": manifests / 1e6, "apparent_tb": apparent / 1e12, "real_mb": real / 1e6,
                "write_s": written, **result}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = (f"{'tokens':>8} {'shards':>7} {'manifests MB':>12} {'apparent TB':>11} {'on disk MB':>10} "
            f"{'1st start s':>11} {'start s':>7} {'peak RSS MiB':>12} {'order KiB':>9} {'batch ms':>8} "
            f"{'1st batch ms':>12} {'all rows ms':>11} {'resume':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['tokens']:>8.1e} {r['shards']:>7,} {r['manifest_mb']:>12.1f} "
                     f"{r['apparent_tb']:>11.2f} {r['real_mb']:>10.1f} {r['first_start_s']:>11.2f} "
                     f"{r['start_s']:>7.2f} {r['peak_rss_mib']:>12.0f} {r['order_bytes'] / 1024:>9.1f} "
                     f"{r['batch_ms']:>8.2f} {r['first_batch_ms']:>12.1f} {r['global_origins_ms']:>11.1f} "
                     f"{'same' if r['resume_equal'] else 'DIFF':>6}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e9,1e11,1e12,1.5e13", help="training tokens per run, comma-separated")
    parser.add_argument("--shard-tokens", type=int, default=1 << 30, help="tokens per shard (2 GiB of uint16)")
    parser.add_argument("--docs-per-shard", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the sparse files go (deleted after)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child: one size, a fresh process so its peak RSS is its own
        print(json.dumps(measure([Path(p) for p in json.loads(args.measure)], Path(args.work))))
        return
    free = shutil.disk_usage(args.dir).free
    print(f"sparse files under {args.dir} ({free / 1e9:.0f} GB free); rank {DP_RANK} of {DP_SIZE}, "
          f"seq_len {SEQ_LEN}, batch {BATCH:,}; load {loadavg()}", flush=True)
    zero_hashes, rows = ZeroHashes(), []
    for total in (int(float(s)) for s in args.sizes.split(",")):
        rows.append(run_size(total, args, Path(args.dir), zero_hashes))
        print(f"{total:.1e} tokens done (writing took {rows[-1]['write_s']:.0f} s)", flush=True)
    print(table(rows))
    print(f"load after: {loadavg()}")
    if not all(r["resume_equal"] for r in rows):
        raise SystemExit("a resumed loader produced another batch")


if __name__ == "__main__":
    main()
