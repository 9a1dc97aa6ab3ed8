"""benchmarks/one_host.py: its table's medians and ratio, and a revision git cannot check out
refused in one line with nothing left behind (the benchmark itself trains 4 jobs a round: run by
hand, its figures in benchmarks/README.md §12)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, SUBPROCESS_ENV, benchmark_module

one_host = benchmark_module("one_host")


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True,
                          check=True).stdout


def test_the_table_gives_each_jobs_medians_over_the_rounds_and_their_ratio():
    names = ["before abc", "this checkout"]
    rows = [{"job": job, "tree": tree, "tokens_per_s": rate}
            for job, tree, rate in [("one process", names[0], 1000.0), ("one process", names[0], 1200.0),
                                    ("one process", names[0], 1100.0), ("one process", names[1], 1320.0),
                                    ("one process", names[1], 1210.0), ("one process", names[1], 1500.0),
                                    ("launch/local.sh 2", names[0], 2000.0), ("launch/local.sh 2", names[1], 1800.0)]]
    lines = one_host.report(rows, names)
    assert lines[2] == "| one process | 1,100; 1,000, 1,200, 1,100 | 1,320; 1,320, 1,210, 1,500 | 1.20 |"
    assert lines[3] == "| launch/local.sh 2 | 2,000; 2,000 | 1,800; 1,800 | 0.90 |"


def test_a_revision_git_cannot_check_out_is_refused_in_one_line():
    before = worktrees()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "one_host.py"), "--before", "no-such-revision"],
                          capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=60)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("benchmarks/one_host.py: --before no-such-revision: git could not check it out")
    assert "give a commit of this repository" in line
    assert worktrees() == before
