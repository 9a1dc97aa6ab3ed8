"""`prepare-data` on datatrove's executors: the same bytes from local processes (1 and 2 workers),
SLURM array jobs across two hosts of the cluster bed, and Ray; a task killed mid-way re-run alone;
every failure of an executor one line."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import signal
import tempfile
from pathlib import Path

import pytest

from trinity_harness.cluster_bed import ClusterBed, SlurmBed, bed_unavailable, leftovers, slurm_unavailable, wait_for
from conftest import ONE_THREAD_ENV, ROOT, assert_one_line_error, cli_in_process
from test_data_prepare import documents, write_jsonl
from trinity_train.data.prepare_steps import KILL_TASK_ENV

TASKS = 3
PREFIX, SUBNET = "tp", "10.216.0"  # beds of this file's own (test_multinode_slurm.py has tq)
RAY_PREFIX, RAY_SUBNET = "tr", "10.217.0"
JOB_TIMEOUT = 240


def corpus(root: Path) -> list[Path]:
    """Five files of seeded documents: three tasks get two, two and one."""
    root.mkdir(parents=True, exist_ok=True)
    return [write_jsonl(root / f"part{i}.jsonl", documents(150, seed=10 + i)) for i in range(5)]


def prepare_args(inputs: list[Path], out: Path, *extra) -> list[str]:
    return ["prepare-data", *[a for p in inputs for a in ("--input", str(p))], "--out", str(out),
            "--train-tokenizer", "300", "--val-fraction", "0.1", "--tasks", str(TASKS), "--shard-tokens", "2000",
            "--no-progress", *map(str, extra)]


def cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a session of its own: the injected kill takes its process group, not the tests'."""
    return subprocess.run([sys.executable, "-m", "trinity_train.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env={**ONE_THREAD_ENV, **(env or {})}, timeout=600,
                          start_new_session=True)


def fingerprint(out: Path) -> dict:
    """The manifest and every file's sha256 as the manifest records them, checked against the files."""
    manifest = json.loads((out / "manifest.json").read_text())
    files = {}
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            for name, info in shard["files"].items():
                assert (out / split / name).stat().st_size == info["bytes"]
                files[f"{split}/{name}"] = info["sha256"]
    return {"manifest": (out / "manifest.json").read_text(), "files": files}


def test_executor_mistakes_are_one_line(capsys, tmp_path, monkeypatch):
    docs = tmp_path / "docs.txt"
    docs.write_text("some words")
    base = ("prepare-data", "--input", docs, "--out", tmp_path / "out", "--train-tokenizer", 300, "--no-progress")
    code, err = cli_in_process(capsys, *base, "--executor", "spark")
    assert_one_line_error(code, err, 2, "--executor must be one of local, slurm, ray, got 'spark'")
    code, err = cli_in_process(capsys, *base, "--tasks", 0)
    assert_one_line_error(code, err, 2, "--tasks")
    monkeypatch.setitem(sys.modules, "ray", None)  # as where ray is not installed
    code, err = cli_in_process(capsys, *base, "--executor", "ray")
    assert_one_line_error(code, err, 2, "--executor ray needs ray", "pip install 'trinity-train[ray]'")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    code, err = cli_in_process(capsys, *base, "--executor", "slurm", "--slurm-partition", "bed")
    assert_one_line_error(code, err, 2, "--executor slurm needs SLURM's sbatch on PATH")
    code, err = cli_in_process(capsys, "prepare-data", "--input", "hub:someone/corpus", "--out", tmp_path / "out",
                               "--train-tokenizer", 300, "--tasks", 2)
    assert_one_line_error(code, err, 2, "a hub dataset is one stream", "--tasks 1")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_task_killed_mid_way_runs_again_alone_and_the_result_is_identical(tmp_path):
    inputs = corpus(tmp_path / "in")
    whole = cli(*prepare_args(inputs, tmp_path / "whole", "--workers", 2))
    assert whole.returncode == 0, whole.stderr
    # The last task SIGKILLs the whole run (one worker: the tasks run in the CLI's process, and
    # datatrove's manager process dies with it) once its first shard is on disk: tasks 0 and 1
    # finished, task 2 half done.
    killed = cli(*prepare_args(inputs, tmp_path / "out", "--workers", 1), env={KILL_TASK_ENV: str(TASKS - 1)})
    assert killed.returncode == -9, killed.stderr
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists() and list((out / "train").glob("2*.json"))
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/[01]*.bin")}
    again = cli(*prepare_args(inputs, out, "--workers", 1))
    assert again.returncode == 0 and "1 of 3 tasks run now" in again.stdout, again.stdout + again.stderr
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/[01]*.bin")} == before  # tasks 0 and 1 not redone
    assert fingerprint(out) == fingerprint(tmp_path / "whole")


# prepare-data whose tasks, once started, say so (a file named by their task in argv[1]) and then
# wait: a run to kill while its workers are busy.
BUSY_TASKS = """
import sys, time
from pathlib import Path
from trinity_train import cli
from trinity_train.data.prepare_steps import TokenizeToShards
run = TokenizeToShards.run
def busy(self, data=None, rank=0, world_size=1):
    (Path(sys.argv[1]) / str(rank)).touch()
    time.sleep(120)
    yield from run(self, data, rank, world_size)
TokenizeToShards.run = busy
sys.exit(cli.main(sys.argv[2:]))
"""


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (state, ppid, ..., [19]: start time); None: no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def descendants(pid: int) -> dict[int, str]:
    """Every live process under `pid` (pid -> start time, so a reused pid is not taken for it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if (fields := proc_stat(child)) and fields[0] != "Z":
            found[child] = fields[19]
            todo += children.get(child, [])
    return found


def still_alive(processes: dict[int, str]) -> list[int]:
    return [pid for pid, start in processes.items()
            if (fields := proc_stat(pid)) and fields[19] == start and fields[0] != "Z"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the workers' hook is Linux's")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_run_leaves_no_process_behind(tmp_path, workers):
    """SIGKILL to prepare-data alone (as `kill -9` or the OOM killer): datatrove's manager process
    and, with 2 workers, its pool die with it instead of staying on, orphaned."""
    started = tmp_path / "started"
    started.mkdir()
    log = (tmp_path / "log.txt").open("w")
    run = subprocess.Popen([sys.executable, "-c", BUSY_TASKS, str(started),
                            *prepare_args(corpus(tmp_path / "in"), tmp_path / "out", "--workers", workers)],
                           cwd=ROOT, env=ONE_THREAD_ENV, stdout=log, stderr=log, start_new_session=True)
    try:
        with contextlib.suppress(TimeoutError):  # up to 120 s for the tokenizer, then `workers` tasks under way
            wait_for(lambda: len(list(started.iterdir())) == workers or run.poll() is not None, 120, 0.1)
        assert run.poll() is None and len(list(started.iterdir())) == workers, (tmp_path / "log.txt").read_text()
        left = descendants(run.pid)
        assert len(left) >= workers  # the manager, and the pool's workers
        os.kill(run.pid, signal.SIGKILL)
        assert run.wait(timeout=30) == -signal.SIGKILL
        with contextlib.suppress(TimeoutError):  # up to 10 s for the kernel to deliver their SIGKILL
            wait_for(lambda: not still_alive(left), 10, 0.1)
        assert still_alive(left) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # the session this test started, should a check fail
        run.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_ray_writes_the_same_bytes_as_local(tmp_path):
    pytest.importorskip("ray", reason="ray is an extra: pip install 'trinity-train[ray]'")
    inputs = corpus(tmp_path / "in")
    local = cli(*prepare_args(inputs, tmp_path / "local", "--workers", 1))
    ray = cli(*prepare_args(inputs, tmp_path / "ray", "--executor", "ray", "--workers", 2))
    assert local.returncode == 0 and ray.returncode == 0, local.stderr + ray.stderr
    assert fingerprint(tmp_path / "ray") == fingerprint(tmp_path / "local")


@pytest.mark.slow
def test_ray_across_two_bed_hosts_writes_the_same_bytes_as_local(tmp_path):
    pytest.importorskip("ray", reason="ray is an extra: pip install 'trinity-train[ray]'")
    reason = bed_unavailable()
    if reason is not None:
        pytest.skip(reason)
    inputs = corpus(tmp_path / "in")
    local = cli(*prepare_args(inputs, tmp_path / "local", "--workers", 1))
    assert local.returncode == 0, local.stderr
    # `ray start` on each host (the head on host 0), one CPU each: the three tasks need both hosts.
    # Its sessions go to a directory of the test's (short: Ray's socket paths must fit), not /tmp/ray,
    # where a later `ray.init()` would find this dead cluster recorded.
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    ray = [str(Path(sys.executable).parent / "ray"), "start", "--num-cpus=1", "--disable-usage-stats",
           f"--temp-dir={temp}"]
    env = {**ONE_THREAD_ENV, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, temp, ignore_errors=True)
        bed = cleanup.enter_context(ClusterBed(2, RAY_PREFIX, RAY_SUBNET, env))
        head = f"{bed.addr(0)}:6379"
        for index, role in ((0, ["--head", "--port=6379", "--include-dashboard=false"]), (1, [f"--address={head}"])):
            done = bed.run(index, *ray, f"--node-ip-address={bed.addr(index)}", *role, timeout=180)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        done = bed.run(0, sys.executable, "-m", "trinity_train.cli",
                       *prepare_args(inputs, tmp_path / "ray", "--executor", "ray", "--ray-address", head),
                       timeout=JOB_TIMEOUT)
        assert "3 of 3 tasks run now" in done.stdout, done.stdout + done.stderr
        records = [json.loads(p.read_text()) for p in sorted((tmp_path / "ray").glob(".prepare/*/records/0*[0-9].json"))]
        assert {r["host"] for r in records} == {bed.host(0), bed.host(1)}, records
    assert leftovers(RAY_PREFIX) == []
    assert fingerprint(tmp_path / "ray") == fingerprint(tmp_path / "local")


@pytest.mark.slow
def test_slurm_across_two_bed_hosts_writes_the_same_bytes_as_local(tmp_path):
    reason = slurm_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the SLURM test: {reason}")
        pytest.skip(reason)
    inputs = corpus(tmp_path / "in")
    for workers in (1, 2):
        done = cli(*prepare_args(inputs, tmp_path / f"local{workers}", "--workers", workers))
        assert done.returncode == 0, done.stderr
    assert fingerprint(tmp_path / "local1") == fingerprint(tmp_path / "local2")
    bed = SlurmBed(PREFIX, SUBNET, ONE_THREAD_ENV, JOB_TIMEOUT)
    try:
        bed.up()
        # Each task asks for every CPU of a host, so the array's tasks run on both hosts at once.
        cpus = os.cpu_count()
        done = bed.script("launch/cluster.sh", "exec", bed.head, sys.executable, "-m", "trinity_train.cli",
                          *prepare_args(inputs, tmp_path / "slurm", "--executor", "slurm", "--slurm-partition", "bed",
                                        "--slurm-time", "00:10:00", "--cpus-per-task", cpus, "--mem-per-cpu-gb", 1),
                          timeout=JOB_TIMEOUT)
        assert "3 of 3 tasks run now" in done.stdout, done.stdout + done.stderr
        records = [json.loads(p.read_text()) for p in sorted((tmp_path / "slurm").glob(".prepare/*/records/0*[0-9].json"))]
        assert {r["host"] for r in records} == {f"{PREFIX}node0", f"{PREFIX}node1"}, records
    finally:
        bed.down()
    assert leftovers(PREFIX) == []
    assert fingerprint(tmp_path / "slurm") == fingerprint(tmp_path / "local1")
