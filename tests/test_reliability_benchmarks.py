"""The reliability benchmarks run end to end and print what benchmarks/README.md quotes: the
checksum candidates against the save time, and restart recovery of the pure-torch reproduction
with a fresh rendezvous store (the launchers' setting). Nothing here asserts a speed."""

from __future__ import annotations

import pytest

from conftest import ONE_THREAD_ENV, run_python

pytestmark = pytest.mark.slow


def run(*args: str) -> str:
    return run_python(*args, env=ONE_THREAD_ENV, ok=True).stdout


def test_checkpoint_hash_compares_the_candidates_with_the_save():
    out = run("benchmarks/checkpoint_hash.py", "--repeats", "1", "--model.hidden_size=64", "--model.num_layers=2",
              "--model.vocab_size=512", "--data.vocab_size=512")
    assert "save (sync, DCP, incl. fsync)" in out
    for name in ("xxh3_128", "sha256", "blake2b"):
        assert f"| {name} |" in out


def test_the_restart_reproduction_recovers_with_a_fresh_store():
    out = run("benchmarks/restart_recovery.py", "--trials", "1", "--variants", "c10d-fresh-store", "--timeout-s", "300")
    assert "| c10d-fresh-store | 1 / 1 |" in out, out
