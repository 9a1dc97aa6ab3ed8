"""The 15T-token rehearsal (benchmarks/loader_at_scale.py) at 10B tokens, still on sparse files:
rank 2047 of 2048 resumes at batch 3,600,000 into the same batch, its sample order holds a few
keys (not a permutation of its ~10^7 sequences), and its peak memory stays far below 1 GiB. The
speeds are the benchmark's to report (benchmarks/README.md), not asserted here."""

from __future__ import annotations

import json

import pytest

from conftest import ONE_THREAD_ENV, ROOT, benchmark_module, run_python

pytestmark = pytest.mark.slow  # writes ~19k sparse files, starts three loaders in a subprocess


def test_rank_2047_of_2048_resumes_at_batch_3_6_million_with_flat_memory(tmp_path):
    bench = benchmark_module("loader_at_scale")
    shard_tokens = 1 << 20  # small shards, so the sources hold ~9.5k (15T tokens: ~14k) and some fall to rank 2047
    dirs, shards = [], []
    for k, (name, tokens) in enumerate(zip(bench.SOURCES, bench.source_tokens(10_000_000_000, shard_tokens))):
        dirs.append(tmp_path / name)
        shards.append(bench.write_sparse_dataset(dirs[-1], tokens, shard_tokens, 64, k, bench.ZeroHashes()))
    apparent, real = bench.disk_use(tmp_path)
    assert apparent > 20e9 and real < 100e6  # holes: 10B tokens of uint16, almost none of it on disk
    out = run_python(ROOT / "benchmarks" / "loader_at_scale.py", "--measure", json.dumps([str(d) for d in dirs]),
                     "--work", tmp_path / "work", env=ONE_THREAD_ENV, ok=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["resume_equal"]
    sequences = 10_000_000_000 // bench.SEQ_LEN
    assert result["order_bytes"] < 1024 < 8 * sequences  # keys, not a permutation (8 bytes a sequence)
    assert result["peak_rss_mib"] < 1024
    own = sum(1 for count in shards for number in range(count) if number % bench.DP_SIZE == bench.DP_RANK)
    assert own > 0 and len(list((tmp_path / "work" / "cache" / "verified").rglob("*.json"))) == own  # its share
