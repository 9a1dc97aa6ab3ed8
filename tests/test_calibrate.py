"""`trinity-train calibrate` (trinity_train/calibrate/): one process measures compute and memory
into a profile `plan --hardware` reads, within its time limit; under a launcher the ranks also
measure their links (inside a node here) for every collective kind the plan prices; a bad option
or a layout the world cannot run is one line before anything is measured. The profile's format
and the plan's pricing on it are tests/test_plan_profile.py's."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch

from conftest import ONE_THREAD_ENV, ROOT, assert_one_line_error, cli_in_process, run_cli
from trinity_train import exit_codes
from trinity_train.calibrate.links import LADDER_STEP, MIN_SIZE
from trinity_train.plan.profile import KINDS, SEND, load_profile

LIMIT_S = 10
# The two-rank job: the default model with EP 2 on one node.
JOB = ("--parallel.ep=2", "--train.micro_batch_size=4", "--train.global_batch_size=8")


def calibrated(out, limit: float) -> dict:
    """`trinity-train calibrate --out OUT --time-limit LIMIT` in one process (one OpenMP thread)."""
    done = run_cli("calibrate", "--out", out, "--time-limit", limit, env=ONE_THREAD_ENV, ok=True)
    return {"out": out, "done": done}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """`trinity-train calibrate --time-limit 10` in one process."""
    return calibrated(tmp_path_factory.mktemp("calibrate") / "profile.json", LIMIT_S)


@pytest.mark.slow  # a calibration of 10 s
def test_one_process_measures_compute_and_memory_into_a_profile(one_process):
    profile = load_profile(one_process["out"])
    assert profile.device == "cpu" and profile.backend == "gloo" and profile.dtype == "float32"
    assert profile.torch == torch.__version__ and profile.config.endswith("configs/debug.toml")
    assert profile.nodes == {socket.gethostname(): [0]} and profile.ranks_per_node == 1
    assert profile.curves == {}  # one process: no link to measure
    assert profile.memory_bytes > 0
    assert profile.matmul_flops > 0 and profile.peak_flops > 0 and profile.step_flops > 0
    assert profile.grouped_flops is not None and profile.grouped_flops > 0  # the default model has routed experts
    assert 0 < profile.mfu < 2  # a training step reaches a fraction of the matmul rate (a little over: noise)
    # Whether it kept the limit is a measurement (benchmarks/plan_vs_measured.py prints it beside
    # the limit), not a test.
    assert profile.time_limit_s == LIMIT_S
    out = one_process["done"].stdout
    assert "links: one process, nothing to measure" in out
    assert f"calibrate: wrote {one_process['out']} in " in out
    assert json.loads(one_process["out"].read_text())["links"] == {}
    assert not one_process["out"].with_name("profile.json.tmp").exists()


@pytest.mark.slow  # a calibration of 10 s (the fixture's) and two plans
def test_a_one_process_profile_prices_a_one_process_cpu_plan_only(one_process, capsys):
    from trinity_train import cli

    code = cli.main(["plan", "--cpu", "--hardware", str(one_process["out"]), "--json"])
    out = capsys.readouterr()
    assert code == exit_codes.DONE, out.err[-3000:]
    st = json.loads(out.out)["step_time"]
    profile = load_profile(one_process["out"])
    assert st["comm_s"] == 0 and st["compute_s"] == pytest.approx(st["flops_per_gpu"] / profile.step_flops)
    assert st["predicted_s"] == st["no_overlap_s"]
    # Two ranks on nodes of the profile's one rank each: their collectives would cross nodes, which
    # one process did not measure.
    code, err = cli_in_process(capsys, "plan", "--cpu", "--hardware", one_process["out"], "--world", "2", "--json")
    assert_one_line_error(code, err, exit_codes.CONFIG, f"{one_process['out']}: the profile has no",
                          "across nodes", "one node: calibrate on at least two nodes")


@pytest.mark.parametrize("limit", ["4", "4.99", "3601", "abc", "nan", "inf", "-10"])
def test_a_time_limit_outside_5_to_3600_seconds_is_one_line(capsys, tmp_path, limit):
    out = tmp_path / "p.json"
    code, err = cli_in_process(capsys, "calibrate", "--out", out, "--time-limit", limit)
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--time-limit '{limit}'", "from 5 to 3600")
    assert not out.exists()


def test_out_must_name_a_file_in_a_folder_that_exists(capsys, tmp_path):
    code, err = cli_in_process(capsys, "calibrate", "--out", tmp_path, "--time-limit", "5")
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--out '{tmp_path}' is a directory",
                          str(tmp_path / "hardware-profile.json"))
    missing = tmp_path / "no" / "such" / "p.json"
    code, err = cli_in_process(capsys, "calibrate", "--out", missing, "--time-limit", "5")
    assert_one_line_error(code, err, exit_codes.CONFIG, f"--out '{missing}'",
                          f"its directory {missing.parent} does not exist")
    assert list(tmp_path.iterdir()) == []


def test_a_layout_one_process_cannot_run_is_one_line(capsys, tmp_path):
    out = tmp_path / "p.json"
    code, err = cli_in_process(capsys, "calibrate", "--out", out, "--time-limit", "5", "--parallel.ep=2")
    assert_one_line_error(code, err, exit_codes.CONFIG, "parallel.ep: ep=2 must divide", "start more processes")
    assert not out.exists()


@pytest.mark.slow  # a two-rank launch (torchrun) calibrating for 20 s, then a plan
def test_two_ranks_measure_every_kind_inside_their_node_and_price_their_plan(tmp_path):
    out = tmp_path / "two.json"
    done = subprocess.run(["launch/local.sh", "2", "calibrate", "--out", str(out), "--time-limit", "20", *JOB],
                          cwd=ROOT, env=ONE_THREAD_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = load_profile(out)
    assert profile.nodes == {socket.gethostname(): [0, 1]} and profile.ranks_per_node == 2
    assert profile.backend == "gloo" and profile.device == "cpu" and profile.torch == torch.__version__
    assert set(profile.curves) == {("inside", kind) for kind in (*KINDS, SEND)}  # one node: nothing across
    for (link, kind), curve in profile.curves.items():
        assert curve.points, (kind, curve)
        sizes = [s for s, _ in curve.points] + ([curve.too_slow[0]] if curve.too_slow else [])
        assert sizes == [MIN_SIZE * LADDER_STEP ** i for i in range(len(sizes))], (kind, sizes)  # the ladder
        assert all(t > 0 for _, t in curve.points)
    assert profile.link_bandwidth("inside") > 0
    assert profile.time_limit_s == 20, done.stdout
    lines = done.stdout.splitlines()
    for kind in KINDS:  # a line per measurement, on rank 0 only
        assert any(line.startswith(f"  inside a node {kind.replace('_', '-')} ") for line in lines), done.stdout
    assert sum(line.startswith("calibrate: wrote") for line in lines) == 1

    plan = run_cli("plan", "--cpu", "--hardware", out, "--world", "2", *JOB, env=ONE_THREAD_ENV)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"calibrated on {socket.gethostname()} (2 ranks a node; cpu, gloo" in plan.stdout
    (predicted,) = [line for line in plan.stdout.splitlines() if line.strip().startswith("predicted:")]
    assert "the no-overlap bound" in predicted, plan.stdout
