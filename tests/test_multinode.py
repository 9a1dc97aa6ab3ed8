"""Multi-node across real network stacks: two hosts of the cluster bed (`launch/cluster.sh`,
namespaces joined by a bridge, each with its own hostname and address), each running
`launch/multinode.sh` as a user would on a node, gloo ranks training a small model.

Traffic goes only to the bed's own addresses (10.216.0.0/24 inside namespaces that have no route
out). Every wait is bounded; the bed is taken down after the module, whatever happened. Without
root or iproute2 the tests skip with the reason, except in CI, where they must run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trinity_harness.cluster_bed import ClusterBed, bed_unavailable, leftovers, surviving_train_records, wait_for
from conftest import SUBPROCESS_ENV, assert_one_line_error, run_cli
from trinity_train.files import read_jsonl
from trinity_train.records import EventName, RecordKind

pytestmark = pytest.mark.slow

PREFIX, SUBNET = "tm", "10.216.0"
JOB_TIMEOUT = 240  # seconds any one job may take before the test fails
# A small model (the default's layout, a quarter of its width: a step is a tenth of the default's)
# on the default corpus; 8-sequence global batches on any number of ranks (2 per rank on 4 ranks,
# gradient accumulation on fewer), a constant learning rate so that a longer run's first steps are
# a shorter run's steps. benchmarks/multinode.py measures the default model across hosts.
STEPS = 4
SMALL_MODEL = ("--model.hidden_size=64", "--model.num_layers=2", "--model.head_dim=16",
               "--model.intermediate_size=128", "--model.moe_intermediate_size=32")
COMMON = (f"--train.steps={STEPS}", "--train.global_batch_size=8", "--train.micro_batch_size=2",
          "--checkpoint.every=2", "--eval.every=0", "--metrics.progress_bar=false",
          "--optim.schedule=constant", *SMALL_MODEL)
FSDP_EP = ("--parallel.ep=2",)          # dp_shard 4 (FSDP over both hosts), experts over 2 ranks of a host
# Expert groups across the hosts are refused unless asked for (parallel/node_layout.py); these
# tests ask, to test the all-to-all across a link.
EP_ACROSS_HOSTS = "--parallel.allow_ep_tp_across_nodes=true"
TP_EP = ("--parallel.tp=2", "--parallel.ep=2", EP_ACROSS_HOSTS)  # tp within a host, dp_shard 2 and ep 2 across hosts
# HSDP 2 x 2 with ep 2 inside each replica: shard and expert groups inside a host, replicas across.
HSDP_EP = ("--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2")


def require_bed() -> None:
    reason = bed_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-node tests: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def bed():
    require_bed()
    cluster = ClusterBed(2, PREFIX, SUBNET, env=SUBPROCESS_ENV)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


_ports = iter(range(29610, 29700))


class Job:
    """One multi-node job on the bed: a launcher per host, all meeting at host 0."""

    def __init__(self, bed: ClusterBed, run_dir: Path, *args: str, nnodes: str = "2", nproc: int = 2,
                 env: dict | None = None):
        self.bed, self.run_dir, self.args = bed, run_dir, args
        self.nnodes, self.nproc = nnodes, nproc
        self.head = f"{bed.addr(0)}:{next(_ports)}"
        self.env = {"RDZV_ID": f"{run_dir.name}-{os.getpid()}", **(env or {})}
        self.nodes: dict[int, object] = {}
        self.logs: list[Path] = []

    def start(self, index: int):
        log = self.run_dir.parent / f"{self.run_dir.name}.node{index}.{len(self.logs)}.log"
        self.logs.append(log)
        self.nodes[index] = self.bed.start(
            index, "launch/multinode.sh", self.nnodes, str(index), self.head, str(self.nproc), "--",
            *COMMON, f"--run.dir={self.run_dir}", *self.args, log=log, env=self.env)
        return self.nodes[index]

    def start_all(self) -> "Job":
        for index in range(self.bed.count):
            self.start(index)
        return self

    def finish(self) -> None:
        """Every node's launcher exits 0 within the job timeout."""
        deadline = time.monotonic() + JOB_TIMEOUT
        for index, proc in self.nodes.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                code = None
            assert code == 0, f"node {index} exited {code}:\n{self.tail()}"

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in self.logs if log.exists())

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return read_jsonl(path) if path.exists() else []

    def checkpointed(self, step: int) -> bool:
        return any(e["event"] == EventName.CHECKPOINT and e["step"] >= step for e in self.events())


def final_train_records(run_dir: Path) -> list[dict]:
    return surviving_train_records(read_jsonl(run_dir / "metrics.jsonl"))


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in final_train_records(run_dir)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """The same job in one process (also builds the default corpus before any host needs it)."""
    run_dir = tmp_path_factory.mktemp("multinode") / "one"
    run_cli("train", *COMMON, f"--run.dir={run_dir}", ok=True, timeout=JOB_TIMEOUT)
    return losses(run_dir)


@pytest.fixture(scope="module")
def fsdp_ep_across_hosts(bed, one_process, tmp_path_factory) -> list[float]:
    """FSDP x EP, 2 hosts x 2 ranks, over a link shaped to 1 Gbit/s: the uninterrupted run that
    the fault tests compare with."""
    run_dir = tmp_path_factory.mktemp("multinode") / "fsdp_ep"
    shaped = bed.shape(1, "rate=1gbit")
    assert shaped.returncode == 0, shaped.stderr
    try:
        Job(bed, run_dir, *FSDP_EP).start_all().finish()
    finally:
        bed.shape(1, "off")
    return losses(run_dir)


def test_bed_hosts_are_separate_machines_with_no_route_out(bed):
    for index in range(2):
        assert bed.run(index, "hostname").stdout.strip() == bed.host(index)
        other = bed.host(1 - index)
        assert bed.run(index, "getent", "hosts", other).stdout.split()[0] == bed.addr(1 - index)
        routes = bed.run(index, "ip", "-o", "route").stdout.strip().splitlines()
        assert [r.strip() for r in routes] == [f"{SUBNET}.0/24 dev eth0 proto kernel scope link src {bed.addr(index)}"]
        # A route lookup (no packet is sent): nothing outside the bed is reachable.
        lookup = bed.run(index, "ip", "route", "get", "10.1.2.3")
        assert lookup.returncode != 0 and "unreachable" in lookup.stderr
    bed.partition(1)
    try:
        assert "NO-CARRIER" in bed.run(1, "ip", "-o", "link", "show", "eth0").stdout
    finally:
        bed.heal(1)
    assert "NO-CARRIER" not in bed.run(1, "ip", "-o", "link", "show", "eth0").stdout


def machine_links() -> list[str]:
    done = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in done.stdout.splitlines())


def test_bed_down_leaves_nothing_behind():
    require_bed()
    prefix = "tl"
    cluster = ClusterBed(2, prefix, "10.217.0", env=SUBPROCESS_ENV)
    links_before = machine_links()
    try:
        cluster.up()
        assert machine_links() == links_before  # the bed's links never sit in the machine's namespace
        sleeper = cluster.start(1, "sleep", "300", log=Path("/dev/null"))
        assert leftovers(prefix)
    finally:
        cluster.down()
    assert sleeper.poll() is not None
    assert leftovers(prefix) == []
    assert machine_links() == links_before
    cluster.down()  # idempotent: nothing to do, no error
    assert leftovers(prefix) == []


def test_launcher_fails_in_one_line_when_the_head_cannot_be_reached(bed, tmp_path):
    # An address inside the bed's subnet that no host has: the launcher waits for it, bounded by
    # parallel.init_timeout_s (5 s here), and says so.
    started = time.monotonic()
    done = bed.run(1, "launch/multinode.sh", "2", "1", f"{SUBNET}.9:29599", "1", "--", *COMMON,
                   f"--run.dir={tmp_path / 'never'}", "--parallel.init_timeout_s=5", timeout=60)
    waited = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert f"the head {SUBNET}.9:29599 did not answer" in lines[0] and "within 5 s" in lines[0]
    assert waited < 30
    # No route at all (a lookup only: the bed has no route out, so no packet leaves).
    done = bed.run(1, "launch/multinode.sh", "2", "1", "10.99.0.1:29599", "1", "--", *COMMON, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "no route from this node" in done.stderr and "10.99.0.1:29599" in done.stderr
    assert not (tmp_path / "never").exists()


def test_nodes_started_with_different_configs_are_refused_on_every_node(bed, tmp_path, one_process):
    run_dir = tmp_path / "mismatch"
    job = Job(bed, run_dir, nproc=1)
    job.start(0)
    job.args = ("--optim.lr=0.01",)  # host 1 is started with one more override
    job.start(1)
    for index, proc in job.nodes.items():
        assert proc.wait(timeout=JOB_TIMEOUT) == 2, job.tail()
    for log in job.logs:
        text = log.read_text()
        lines = [line for line in text.splitlines() if line.strip()]
        assert_one_line_error(2, lines[-1], 2, "different configs", "optim.lr", "host tmnode1")
        # The one line, once, and no restart. (A node whose head's torchrun exits first may also
        # get torchrun's warning that it could not close the rendezvous: torch's own noise.)
        assert sum(line.startswith("error: ") for line in lines) == 1, text
        assert "will restart worker group" not in text, text
    assert not any(e["event"] == EventName.RUN_START for e in job.events())


def test_fsdp_ep_across_hosts_over_a_shaped_link_equals_one_process(fsdp_ep_across_hosts, one_process):
    assert len(fsdp_ep_across_hosts) == STEPS
    assert fsdp_ep_across_hosts == pytest.approx(one_process, rel=1e-5)


# Machine drills that leave the numbers alone, across hosts: rank 3 (on whichever host the
# rendezvous put it) given 4 s of extra compute in every iteration, its checkpoint write of
# iteration 2 failing. The job judges stragglers at 3x, not the default 1.5x: a clean rank's
# single reports reach 2.4x on a loaded machine (rank 0 was flagged at 1.5x in one CI run). The
# others compute 0.27-0.45 s an iteration (at load 1 as beside three CPU hogs at load 5.7), 0.9-1.1 s
# in the first; yet in one CI run 2 s of drill never stood above 3x in two reports in a row (the
# test now prints the reports when it fails), so the drill is 4 s: rank 3 stays above 3x until
# the others' median passes 2 s.
ACROSS_HOSTS_DRILLS = ('--stability.inject=[{fault="slow_rank", first=1, last=4, rank=3, seconds=4.0}, '
                       '{fault="fail_save", first=2, rank=3}]')


# The exposed-communication job: 2 hosts x 1 rank, FSDP x EP, a report every 2 iterations. The
# link is shaped once the report of iteration 4 is written (the one of iteration 2 holds the
# start-up); iterations 5-6 may straddle the change; 7-10 run shaped.
EXPOSED_STEPS, UNSHAPED_REPORT, SHAPED_FROM, SHAPED_RATE_MBIT = 10, 4, 7, 20


def ranks_reports(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    return {r["iter"]: r for r in (read_jsonl(path) if path.exists() else []) if r.get("kind") == RecordKind.RANKS}


def test_exposed_communication_grows_when_the_link_is_shaped(bed, one_process, tmp_path):
    """One job, its link shaped to SHAPED_RATE_MBIT halfway: every byte of a shaped iteration takes
    bytes / rate to cross, which the ranks' compute cannot hide (no rank overlaps more than it
    computes), so the exposed seconds per iteration grow by at least that time less the compute
    (halved for the shaper's burst and the end's bytes in the count)."""
    run_dir = tmp_path / "run"
    job = Job(bed, run_dir, *FSDP_EP, EP_ACROSS_HOSTS, f"--train.steps={EXPOSED_STEPS}", "--checkpoint.every=0",
              "--metrics.rank_stats_every=2", nproc=1).start_all()
    try:
        def reported_or_ended() -> bool:  # a job that failed ends early: finish() then says why
            return UNSHAPED_REPORT in ranks_reports(run_dir) or any(p.poll() is not None for p in job.nodes.values())

        wait_for(reported_or_ended, JOB_TIMEOUT, interval=0.1, what=f"the report of iteration {UNSHAPED_REPORT}")
        shaped_ok = bed.shape(1, f"rate={SHAPED_RATE_MBIT}mbit")
        assert shaped_ok.returncode == 0, shaped_ok.stderr
        before = bed.wire_bytes(1)
        job.finish()
        after = bed.wire_bytes(1)
    finally:
        bed.shape(1, "off")
    reports = ranks_reports(run_dir)
    assert all(len(r["comm_exposed_s"]) == 2 for r in reports.values())
    unshaped = sum(reports[UNSHAPED_REPORT]["comm_exposed_s"]) / 2
    late = [r for i, r in reports.items() if i >= SHAPED_FROM + 1]
    shaped = sum(sum(r["comm_exposed_s"]) for r in late) / (2 * len(late))
    compute = sum(sum(r["compute_s"]) for r in late) / (2 * len(late))
    bytes_per_iter = max(a - b for a, b in zip(after, before)) / (EXPOSED_STEPS - UNSHAPED_REPORT)
    transfer_s = bytes_per_iter * 8 / (SHAPED_RATE_MBIT * 1e6)
    print(f"exposed {unshaped:.4f} -> {shaped:.4f} s per iteration; {bytes_per_iter / 1e6:.2f} MB per iteration "
          f"= {transfer_s:.4f} s at {SHAPED_RATE_MBIT} Mbit/s; compute {compute:.4f} s")
    assert shaped >= unshaped + 0.5 * transfer_s - compute > unshaped


def test_tp_ep_across_hosts_equals_one_process(bed, one_process, tmp_path):
    """TP x EP over both hosts trains the one-process losses, also while drills act on one rank:
    the slowed rank is named a straggler on its host, its failed save fails the save on every
    rank, is recorded, and the job trains on to the next checkpoint."""
    run_dir = tmp_path / "tp_ep"
    Job(bed, run_dir, *TP_EP, ACROSS_HOSTS_DRILLS, "--metrics.rank_stats_every=1",
        "--metrics.straggler_ratio=3", "--metrics.straggler_reports=2").start_all().finish()
    assert losses(run_dir) == pytest.approx(one_process, rel=1e-5)
    events = Job(bed, run_dir).events()
    (hosts,) = [e for e in events if e["event"] == EventName.RANK_HOSTS]
    assert sorted(hosts["hosts"]) == [bed.host(0), bed.host(0), bed.host(1), bed.host(1)]
    stragglers = [e for e in events if e["event"] == EventName.STRAGGLER]
    compute_by_iteration = {i: r["compute_s"] for i, r in ranks_reports(run_dir).items()}
    assert [(e["rank"], e["host"]) for e in stragglers] == [(3, hosts["hosts"][3])], compute_by_iteration
    (failed,) = [e for e in events if e["event"] == EventName.CHECKPOINT_FAILED]
    assert failed["step"] == 2 and "fail_save" in failed["error"]
    assert [e["step"] for e in events if e["event"] == EventName.CHECKPOINT] == [STEPS]


def test_hsdp_with_replicas_across_hosts_equals_one_process(bed, one_process, tmp_path):
    """The cluster-shaped layout: HSDP 2 x 2 with EP inside each replica on 2 hosts x 2 ranks keeps
    the shard and expert groups on one host each (no flag needed: parallel/node_layout.py), so only
    the replicas' all-reduce crosses the link; it trains the one-process losses."""
    run_dir = tmp_path / "hsdp"
    Job(bed, run_dir, *HSDP_EP).start_all().finish()
    assert losses(run_dir) == pytest.approx(one_process, rel=1e-5)
    (hosts,) = [e["hosts"] for e in Job(bed, run_dir).events() if e["event"] == EventName.RANK_HOSTS]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # ranks are numbered host by host


def test_lost_node_restarted_by_a_scheduler_resumes_identically(bed, fsdp_ep_across_hosts, tmp_path):
    """Every process of host 1 SIGKILLed after the first checkpoint; its launcher started again (as
    a scheduler would): the job resumes from the newest sound checkpoint, bit for bit."""
    run_dir = tmp_path / "node_loss"
    job = Job(bed, run_dir, *FSDP_EP).start_all()
    wait_for(lambda: job.checkpointed(2), JOB_TIMEOUT, what="the first checkpoint")
    bed.kill_host(1)
    job.start(1)
    job.finish()
    starts = [e for e in job.events() if e["event"] == EventName.RUN_START]
    assert len(starts) >= 2 and starts[-1]["resumed_from"], starts
    assert losses(run_dir) == fsdp_ep_across_hosts


def test_elastic_job_carries_on_without_a_lost_node_and_takes_it_back(bed, one_process, tmp_path):
    """--nnodes=1:2, 2 hosts x 1 rank (FSDP over both): host 1 lost after a checkpoint, host 0
    carries on alone on the same global batches in the same order; host 1, started again,
    rejoins at the next rendezvous."""
    run_dir = tmp_path / "elastic"
    # Host 0 alone must still be training when host 1 is back: at low load it trained 9 steps in
    # 4.8 s, finished the job and took the rendezvous store with it before host 1 had rejoined
    # (CI, 2026-12-03); 30 steps leave host 1 ~20 s to start and rejoin.
    steps = 30
    job = Job(bed, run_dir, "--checkpoint.every=1", f"--train.steps={steps}", nnodes="1:2", nproc=1,
              env={"RDZV_LAST_CALL_S": "2"}).start_all()
    wait_for(lambda: job.checkpointed(1), JOB_TIMEOUT, what="the first checkpoint")
    bed.kill_host(1)

    def trained_alone() -> bool:
        alone = [e for e in job.events() if e["event"] == EventName.RUN_START and e["devices"] == 1]
        return bool(alone) and job.checkpointed(alone[0]["step"] + 1)
    wait_for(trained_alone, JOB_TIMEOUT, what="host 0 training alone")
    job.start(1)
    job.finish()
    sizes = [e["devices"] for e in job.events() if e["event"] == EventName.RUN_START]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    records = final_train_records(run_dir)
    assert [r["batch"] for r in records] == list(range(steps))  # no batch twice, none skipped
    assert [r["tokens"] for r in records] == [8 * 256] * steps
    # A constant learning rate: the first steps are the shorter reference's, on 2 ranks or 1.
    assert losses(run_dir)[:STEPS] == pytest.approx(one_process, rel=1e-4)


def seconds_to_next_step(job: Job, fault_time: float) -> float:
    """Seconds from the fault to the first step trained after it (observed every 0.5 s): the
    restarted attempt's start moves the records past its checkpoint out of metrics.jsonl before
    it writes its run_start event, so any later training record is the restarted job's."""
    def restart() -> dict | None:
        return next((e for e in job.events() if e["event"] == EventName.RUN_START and e["time"] > fault_time), None)
    resumed_iter = wait_for(restart, JOB_TIMEOUT, what="a restart after the fault")["iter"]

    def trained() -> bool:
        return any(r["kind"] == RecordKind.TRAIN and r["iter"] > resumed_iter
                   for r in read_jsonl(job.run_dir / "metrics.jsonl"))
    wait_for(trained, JOB_TIMEOUT, what="a step after the restart")
    return time.time() - fault_time


def test_partition_and_frozen_rank_are_detected_and_recovered(bed, one_process, tmp_path):
    """Host 1's link down for longer than the collective timeout, then up; later one of its ranks
    frozen (SIGSTOP) for longer than the timeout: each time the ranks that wait time out, torchrun
    restarts the job from its newest checkpoint, and it finishes with the uninterrupted run's
    losses. 2 hosts x 1 rank. The frozen rank is let go (SIGCONT) once the others have timed out;
    one that stays frozen is killed by torchrun after its 30 s SIGTERM grace, which
    benchmarks/multinode.py measures."""
    run_dir = tmp_path / "partition"
    timeout_s = 6
    steps = 6  # two faults, each followed by steps
    job = Job(bed, run_dir, *FSDP_EP, EP_ACROSS_HOSTS, "--checkpoint.every=1",
              f"--parallel.collective_timeout_s={timeout_s}", f"--train.steps={steps}", nproc=1).start_all()
    wait_for(lambda: job.checkpointed(1), JOB_TIMEOUT, what="the first checkpoint")
    fault_time = time.time()
    bed.partition(1)
    time.sleep(timeout_s * 2)
    bed.heal(1)
    partition_s = seconds_to_next_step(job, fault_time)

    fault_time = time.time()
    workers = bed.worker_pids(1)
    assert workers
    os.kill(workers[0], signal.SIGSTOP)
    time.sleep(timeout_s + 4)
    os.kill(workers[0], signal.SIGCONT)
    frozen_s = seconds_to_next_step(job, fault_time)
    job.finish()
    print(f"fault to next trained step: partition {partition_s:.1f} s, frozen rank {frozen_s:.1f} s")
    restarts = [e for e in job.events() if e["event"] == EventName.RUN_START]
    assert len(restarts) == 3, restarts
    assert len(losses(run_dir)) == steps
    assert losses(run_dir)[:STEPS] == pytest.approx(one_process, rel=1e-5)
