"""The reliability benchmarks run end to end and print what benchmarks/README.md quotes: the
checksum candidates against the save time, and restart recovery of the pure-torch reproduction
with a fresh rendezvous store (the launchers' setting). Nothing here asserts a speed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_checkpoint_hash_compares_the_candidates_with_the_save():
    out = run("benchmarks/checkpoint_hash.py", "--repeats", "1", "--model.hidden_size=64", "--model.num_layers=2",
              "--model.vocab_size=512", "--data.vocab_size=512")
    assert "save (sync, DCP, incl. fsync)" in out
    for name in ("xxh3_128", "sha256", "blake2b"):
        assert f"| {name} |" in out


def test_the_restart_reproduction_recovers_with_a_fresh_store():
    out = run("benchmarks/restart_recovery.py", "--trials", "1", "--variants", "c10d-fresh-store", "--timeout-s", "300")
    assert "| c10d-fresh-store | 1 / 1 |" in out, out
