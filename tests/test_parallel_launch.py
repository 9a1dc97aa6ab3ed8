"""The launchers, end to end through torchrun and the CLI: an impossible layout stops every rank
with one clear line before any work, and a mistake inside the workers is not restarted. Training
across nodes is tested across the hosts of the cluster bed (tests/test_multinode.py)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT, SUBPROCESS_ENV, layout_config
from trinity_train.config import save_config


def launch(*args, **env: str) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], cwd=ROOT, env={**SUBPROCESS_ENV, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


@pytest.fixture
def ep2_config(corpus, tmp_path):
    path = tmp_path / "ep2.toml"
    save_config(layout_config(corpus, tmp_path / "unused", {"parallel": {"ep": 2}}, world=2), path)
    return path


@pytest.mark.parametrize("launcher", [("launch/local.sh", 2),
                                      ("launch/multinode.sh", 2, 0, "127.0.0.1", 1, "--")])
def test_impossible_layout_is_refused_before_anything_starts(ep2_config, tmp_path, launcher):
    run_dir = tmp_path / "never"
    code, log = finish(launch(*launcher, "--config", ep2_config, "--parallel.ep=1",
                              "--parallel.dp_shard=4", f"--run.dir={run_dir}"))
    assert code == 2, log
    assert log.strip() == ("error: parallel: dp_replicate=1 x dp_shard=4 x tp=1 = 4 ranks, but 2 "
                           "processes were started; start 4 processes or set parallel.dp_shard=-1 "
                           "to use what is left")
    assert not run_dir.exists()


def test_expert_groups_across_nodes_are_refused_before_anything_starts(ep2_config, tmp_path):
    """2 nodes of 1 rank with ep=2: each expert group would span both nodes; the launcher refuses
    in one line, naming the flag that runs it anyway."""
    run_dir = tmp_path / "never"
    code, log = finish(launch("launch/multinode.sh", 2, 0, "127.0.0.1", 1, "--", "--config", ep2_config,
                              f"--run.dir={run_dir}"))
    assert code == 2, log
    (line,) = log.strip().splitlines()
    assert line.startswith("error: parallel.ep: ep=2 would put its groups across nodes: each spans ep x tp = 2 "
                           "neighbouring ranks, which nodes of 1 ranks (the launcher's processes per node; 2 nodes)")
    assert line.endswith("or set parallel.allow_ep_tp_across_nodes=true to run it anyway")
    assert not run_dir.exists()


def test_multinode_script_explains_a_missing_head_address(tmp_path):
    env = {k: v for k, v in SUBPROCESS_ENV.items() if k not in ("MASTER_ADDR", "NNODES", "NODE_RANK")}
    done = subprocess.run(["launch/multinode.sh", "2", "0"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "head address is missing" in done.stderr


@pytest.mark.slow  # a torchrun launch of two workers
def test_a_mistake_inside_the_workers_is_not_restarted(ep2_config, tmp_path):
    """A UserError every rank meets after torchrun started them (here a checkpoint to resume that
    does not exist) ends the job once, with the one line and its exit code, instead of being
    restarted --max-restarts times (launcher_verdict)."""
    run_dir = tmp_path / "never"
    proc = subprocess.Popen(["launch/local.sh", "2", "--max-restarts=3", "--config", str(ep2_config),
                             f"--run.dir={run_dir}", f"--checkpoint.resume={tmp_path / 'no_such_checkpoint'}"],
                            cwd=ROOT, env={**SUBPROCESS_ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, err
    assert lines == [lines[-1]] and lines[-1].startswith("error: ") and "no_such_checkpoint" in lines[-1], err
