"""SLURM on the cluster bed: `launch/slurm.sbatch`, submitted with `sbatch` to slurmctld and two
slurmd of `launch/cluster_slurm.sh` on two namespace hosts of `launch/cluster.sh`, trains across
both hosts (one rank each, CPU nodes) like `launch/local.sh 2` on one machine; cancelled with
`scancel` after its first checkpoint, it is continued by the same command submitted again, and the
two jobs' losses are the one-machine run's. (One job cancelled and one resumed cover an
uninterrupted job's checks too: each trained across both hosts, and together they trained every
step.) Everything is taken down afterwards and the test checks that nothing is left.

Traffic goes only to the bed's own addresses (10.215.0.0/24 inside namespaces that have no route
out). Every wait is bounded. Without root, iproute2, slurm-wlm or munge the test skips with the
reason, except in CI, where it must run (.ci/run installs them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trinity_harness.cluster_bed import SlurmBed, leftovers, slurm_unavailable
from conftest import ONE_THREAD_ENV, ROOT, layout_config
from trinity_train.config import save_config
from trinity_train.files import read_jsonl
from trinity_train.records import EventName, RecordKind

pytestmark = pytest.mark.slow

PREFIX, SUBNET = "tq", "10.215.0"
# 24 steps, a checkpoint every 8: the first job is cancelled once step 8's is on disk, 16 steps
# (seconds) before it would end.
STEPS, EVERY = 24, 8
JOB_TIMEOUT = 120  # seconds any one job may take (queued and running) before the test fails


def train_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step trained twice (after a resume) counts as last trained."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == RecordKind.TRAIN}


def test_sbatch_trains_across_two_hosts_and_a_cancelled_job_resumes(corpus, tmp_path):
    reason = slurm_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the SLURM test: {reason}")
        pytest.skip(reason)
    config = tmp_path / "ep2.toml"
    # One rank per host: the expert groups span both, which has to be asked for (parallel/node_layout.py).
    parallel = {"ep": 2, "allow_ep_tp_across_nodes": True}
    save_config(layout_config(corpus, tmp_path / "unused", {"parallel": parallel}, world=2), config)
    common = ("--config", str(config), f"--train.steps={STEPS}", f"--checkpoint.every={EVERY}",
              "--checkpoint.resume=auto")
    bed = SlurmBed(PREFIX, SUBNET, ONE_THREAD_ENV, JOB_TIMEOUT)
    reference = None
    try:
        bed.up()
        assert len(bed.daemon_pids()) >= 4  # munged, slurmctld, two slurmd: what the check below sees

        # The reference on this machine, while the first job runs on the bed (the math is the same).
        with open(tmp_path / "one.log", "w") as log:
            reference = subprocess.Popen(["launch/local.sh", "2", *common, f"--run.dir={tmp_path / 'one'}"],
                                         cwd=ROOT, env=ONE_THREAD_ENV, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        # The first job is cancelled once its first checkpoint is on disk (a complete checkpoint
        # has its final name).
        run = tmp_path / "run"
        first_out = tmp_path / "first.out"
        first = bed.submit(first_out, *common, f"--run.dir={run}")
        deadline = time.monotonic() + JOB_TIMEOUT
        for poll in range(int(JOB_TIMEOUT / 0.05)):
            if (run / "checkpoints" / f"step_{EVERY:08d}").is_dir():
                break
            assert time.monotonic() < deadline, f"no checkpoint within {JOB_TIMEOUT} s: {first_out.read_text()[-2000:]}"
            if poll % 20 == 19:  # a job that failed before it got there ends the wait
                assert bed.job(first)["JobState"] in ("PENDING", "RUNNING"), first_out.read_text()[-3000:]
            time.sleep(0.05)
        bed.client("scancel", first)
        job = bed.wait_ended(first, first_out)
        assert job["JobState"] == "CANCELLED", job
        events = [e["event"] for e in read_jsonl(run / "events.jsonl")]
        assert EventName.RUN_END not in events, "the job ended before scancel reached it; raise STEPS"

        assert reference.wait(timeout=JOB_TIMEOUT) == 0, (tmp_path / "one.log").read_text()[-3000:]
        one = train_losses(tmp_path / "one")
        assert sorted(one) == list(range(1, STEPS + 1))
        # The job trained on both hosts, one rank each, like the two ranks on one machine.
        assert job["NodeList"] == f"{PREFIX}node[0-1]", job
        cancelled = train_losses(run)
        assert len(cancelled) >= EVERY and cancelled == pytest.approx({s: one[s] for s in cancelled}, rel=1e-6)

        # The same command again continues from the checkpoint, to the losses of the whole run.
        again_out = tmp_path / "again.out"
        again = bed.submit(again_out, *common, f"--run.dir={run}")
        job = bed.wait_ended(again, again_out)
        assert job["JobState"] == "COMPLETED" and job["NodeList"] == f"{PREFIX}node[0-1]", again_out.read_text()[-3000:]
        resumes = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == EventName.RESUME]
        assert len(resumes) == 1 and resumes[0]["step"] >= EVERY, resumes
        assert train_losses(run) == pytest.approx(one, rel=1e-6)
        # Host 1's slurmd started a task of each job: a rank of each trained there.
        slurmd_log = (bed.state / "slurm" / "log" / f"slurmd-{PREFIX}node1.log").read_text()
        assert f"launch task StepId={first}.0 " in slurmd_log and f"launch task StepId={again}.0 " in slurmd_log
    finally:
        if reference is not None and reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait(timeout=30)
        bed.down()
    assert leftovers(PREFIX) == []
    assert not bed.daemon_pids()
