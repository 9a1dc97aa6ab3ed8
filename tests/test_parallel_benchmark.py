"""benchmarks/parallel_comm.py runs and reports what the issue asks: all-to-all bytes next to the
theoretical count, and FSDP=2 holding at most 0.55x of FSDP=1's parameter + optimizer memory."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT, last_table, run_python

pytestmark = pytest.mark.slow  # runs a benchmark script on gloo ranks in a subprocess
TINY = ["--model.vocab_size=256", "--model.hidden_size=64", "--model.num_layers=2",
        "--model.intermediate_size=128", "--model.moe_intermediate_size=32", "--data.seq_len=32",
        "--model.sliding_window=16"]


def test_benchmark_reports_all_to_all_bytes_and_fsdp_memory():
    out = run_python(ROOT / "benchmarks" / "parallel_comm.py", "--ep", "2", "--fsdp", "1", "2", *TINY,
                     timeout=300, ok=True).stdout
    # 64 tokens per rank x top-2 x hidden 64 x 4 bytes x 1/2
    assert "= 16,384 B" in out
    ratios = [float(r) for r in re.findall(r"mean [\d,]+ B per all-to-all = ([\d.]+) x theory", out)]
    assert len(ratios) == 2 and all(0.3 < r < 1.7 for r in ratios), out
    fsdp2 = float(re.search(r"FSDP=2: +[\d.]+ MiB = ([\d.]+) x FSDP=1", out).group(1))
    assert fsdp2 <= 0.55, out
    table = last_table(out)
    assert table[0] == "| measurement | measured | against | ratio | target |", out
    assert re.fullmatch(r"\| EP=2 all-to-all, forward: mean B per call \| [\d,]+ \| 16,384 \(theory\) "
                        r"\| [\d.]+x \| .+ \|", table[2]), out
    row = re.fullmatch(r"\| FSDP=2: parameters \+ AdamW state of one rank, MiB \| [\d.]+ \| [\d.]+ \(FSDP=1\) \| "
                       r"([\d.]+)x \| <= 0.55 \|", table[-1])
    assert row and float(row.group(1)) == fsdp2, out
