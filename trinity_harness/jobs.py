"""The job runner of the benchmarks (and the tests that check them): training jobs launched as a
user launches them, on this host (`launch/local.sh`) or on the cluster bed's two hosts
(`launch/multinode.sh` on each, `cluster_bed.ClusterBed`), their links shaped, their records read
back, and the machine's load, CPU time and wire bytes around them.

`bench_on_bed()` brings the bed up and yields a `Bench` over it; `Bench.throughput_job` runs one
job of the benchmark's model (`COMMON`: the default model, FSDP x EP on 2 gloo ranks, global batch
8 x 256 tokens, one OpenMP thread a rank) under one of `CONDITIONS` and returns its medians after
the first `WARMUP_ITERS` steps. `calibrate` measures what gloo puts on the bed's wire per byte a
collective is credited with. `loadavg()` is the one load-average reading of the tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trinity_harness.cluster_bed import ClusterBed, wait_for
from trinity_harness.instruments import COUNTER_ENV, WAITS_ENV
from trinity_harness.train_instrumented import GLOO_OVERLAP_ENV
from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER,
                                            FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE)
from trinity_train.files import read_jsonl
from trinity_train.records import EventName

ROOT = Path(__file__).resolve().parents[1]
PREFIX, SUBNET = "tb", "10.218.0"
WARMUP_ITERS = 3
JOB_TIMEOUT_S = 600      # any throughput job
RANK_STATS_EVERY = 4  # the ranks records (exposed communication) over 4 iterations each
COMMON = ("--parallel.ep=2", "--train.global_batch_size=8", "--train.micro_batch_size=4",
          "--eval.every=0", "--checkpoint.every=0", "--metrics.progress_bar=false",
          "--metrics.layer_stats_every=0", "--optim.schedule=constant", f"--metrics.rank_stats_every={RANK_STATS_EVERY}")


@dataclass(frozen=True)
class Layout:
    """How a job places its ranks: `ranks_per_host` on each of the bed's 2 hosts, or twice that on
    one host (`launch/local.sh`), with `args` after COMMON."""

    ranks_per_host: int
    args: tuple[str, ...]
    one_host: str  # condition a's name
    two_hosts: str  # the bed conditions' prefix

    def condition(self, letter: str, shaped: str | None) -> str:
        return f"{letter}: {self.one_host}" if shaped is None else f"{letter}: {self.two_hosts}, {shaped}"


# The 2-rank job. One rank per host puts the expert groups across the link: asked for.
PAIR = Layout(1, ("--parallel.allow_ep_tp_across_nodes=true",), "1 host x 2 ranks", "2 hosts")
# (letter, what the name says of the link, shape settings; None: one host, loopback). Delays only
# where the kernel has netem.
CONDITIONS = (
    ("a", None, None),
    ("b", "unshaped", ()),
    ("c", "1 Gbit/1 ms", ("rate=1gbit", "delay=1ms")),
    ("d", "200 Mbit/5 ms", ("rate=200mbit", "delay=5ms")),
)
INSTRUMENTED_TRAIN = "trinity_harness.train_instrumented"  # the launchers' TRAIN_MODULE for an instrumented job


def instrumented_env(env_name: str, out_dir: Path) -> dict:
    """The environment of a job whose ranks run the instrument `env_name` names
    (`instruments.COUNTER_ENV` or `WAITS_ENV`) into `out_dir` (created): the launchers start
    `train_instrumented` instead of `trinity_train.cli` (their TRAIN_MODULE), which installs it."""
    assert env_name in (COUNTER_ENV, WAITS_ENV), env_name
    out_dir.mkdir()
    return {env_name: str(out_dir), "TRAIN_MODULE": INSTRUMENTED_TRAIN}


def gloo_overlap_env(setting: str) -> dict:
    """The environment of a job whose ranks run a CPU job's overlaps as `setting` says
    (`train_instrumented.GLOO_OVERLAP_ENV`: "none", or some of "reduce_scatter,all_gather")."""
    return {GLOO_OVERLAP_ENV: setting, "TRAIN_MODULE": INSTRUMENTED_TRAIN}


def loadavg() -> str:
    """The machine's 1, 5 and 15 minute load averages (/proc/loadavg), as printed beside every figure."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def wire_bytes(host: str | None) -> tuple[int, int]:
    """(rx, tx) bytes of HOST's eth0 (None: the eth0 of this process's own network namespace)."""
    netns = ["-n", host] if host else []
    done = subprocess.run(["ip", *netns, "-s", "-j", "link", "show", "eth0"], capture_output=True,
                          text=True, timeout=10, check=True)
    stats = json.loads(done.stdout)[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


CPU_KINDS = ("user", "system", "softirq", "idle")


def cpu_seconds() -> dict[str, float]:
    """The machine's CPU seconds so far, every core and every namespace together (/proc/stat):
    user (with nice), system, softirq (the kernel's packet work: the link's shaping and TCP), idle."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, idle, _iowait, _irq, softirq = values
    tick = os.sysconf("SC_CLK_TCK")
    return {kind: value / tick for kind, value in zip(CPU_KINDS, (user + nice, system, softirq, idle))}


def median_tokens_per_s(records: list[dict]) -> float:
    rates = [r["tokens"] / r["step_time_s"] for r in records if r["iter"] > WARMUP_ITERS]
    return statistics.median(rates)


def median_step_s(records: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in records if r["iter"] > WARMUP_ITERS)


def exposed(row: dict) -> str:
    return "-" if row.get("exposed_s") is None else f"{row['exposed_s']:.2f}"


def median_rank_stat(run_dir: Path, field: str) -> float | None:
    """A `ranks` record's `field` of its largest rank (`comm_exposed_s`: seconds per iteration the
    most-blocked rank waited in collectives; `compute_s`: the busiest rank's compute), the median
    over the reports after the warm-up; None without reports."""
    reports = [max(r[field]) for r in read_jsonl(run_dir / "metrics.jsonl")
               if r.get("kind") == "ranks" and r["iter"] - RANK_STATS_EVERY >= WARMUP_ITERS]
    return statistics.median(reports) if reports else None


class Bench:
    def __init__(self, bed, work: Path, env: dict):
        self.bed, self.work, self.env = bed, work, env
        self.local_procs: list[subprocess.Popen] = []
        self.port = 29810
        self.jobs = 0
        self.netem: bool | None = None
        self.shape_note = ""

    def next_job(self, name: str) -> tuple[Path, str, dict]:
        self.jobs += 1
        self.port += 1
        run_dir = self.work / f"{self.jobs:02d}-{name}"
        env = {"RDZV_ID": f"bench-{os.getpid()}-{self.jobs}", "MAX_RESTARTS": "0"}
        return run_dir, f"{self.bed.addr(0)}:{self.port}", env

    def start_bed_job(self, run_dir: Path, head: str, env: dict, args: tuple[str, ...], index: int | None = None,
                      layout: Layout = PAIR):
        procs, logs = {}, []
        for i in ([0, 1] if index is None else [index]):
            log = run_dir.parent / f"{run_dir.name}.node{i}.{time.monotonic_ns()}.log"
            logs.append(log)
            procs[i] = self.bed.start(i, "launch/multinode.sh", "2", str(i), head, str(layout.ranks_per_host), "--",
                                      *COMMON, *layout.args, f"--run.dir={run_dir}", *args, log=log, env=env)
        return procs, logs

    def shape(self, settings: tuple[str, ...]) -> str:
        """Shape host 1's link; drop the delays where the kernel has no netem. Returns what was set."""
        if not settings:
            return "none"
        done = self.bed.shape(1, *settings)
        if done.returncode != 0 and "netem" in done.stderr:
            self.netem = False
            self.shape_note = done.stderr.strip().splitlines()[-1]
            settings = tuple(s for s in settings if s.startswith("rate="))
            done = self.bed.shape(1, *settings)
        elif done.returncode == 0 and any(s.startswith("delay=") for s in settings):
            self.netem = True
        if done.returncode != 0:
            raise RuntimeError(f"shape {settings}: {done.stderr.strip()}")
        return " ".join(settings)

    def throughput_job(self, name: str, settings: tuple[str, ...] | None, steps: int,
                       extra_env: dict | None = None, layout: Layout = PAIR,
                       extra_args: tuple[str, ...] = ()) -> dict:
        run_dir, head, env = self.next_job(name.split(":")[0])
        env = {**env, **(extra_env or {})}
        args = (f"--train.steps={steps}", *extra_args)
        load_start = loadavg()
        shaped = "loopback"
        logs: list[Path] = []
        try:
            if settings is None:
                log = run_dir.parent / f"{run_dir.name}.log"
                logs.append(log)
                with open(log, "w") as out:
                    proc = subprocess.Popen(["launch/local.sh", str(2 * layout.ranks_per_host), *COMMON,
                                             *layout.args, f"--run.dir={run_dir}", *args],
                                            cwd=ROOT, env={**self.env, **env}, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                self.local_procs.append(proc)
                procs = {0: proc}
            else:
                shaped = self.shape(settings)
                procs, logs = self.start_bed_job(run_dir, head, env, args, layout=layout)
            # Host 1's counters and the machine's CPU time at the end of the warm-up and one step
            # before the last.
            marks: dict[int, tuple[int, tuple[int, int] | None, dict[str, float]]] = {}
            deadline = time.monotonic() + JOB_TIMEOUT_S
            size = -1
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: not finished within {JOB_TIMEOUT_S} s")
                if len(marks) < 2:
                    metrics = run_dir / "metrics.jsonl"
                    now = metrics.stat().st_size if metrics.exists() else 0
                    if now != size:
                        size = now
                        done_iters = len(train_records(run_dir))
                        for mark in (WARMUP_ITERS, steps - 1):
                            if done_iters >= mark and mark not in marks:
                                wire = wire_bytes(self.bed.host(1)) if settings is not None else None
                                marks[mark] = (done_iters, wire, cpu_seconds())
                time.sleep(0.05)
            for i, p in procs.items():
                if p.returncode != 0:
                    raise RuntimeError(f"{name}: node {i} exited {p.returncode}\n" + tail(logs))
        finally:
            if settings:
                self.bed.shape(1, "off")
        records = train_records(run_dir)
        result = {"condition": name, "shaping": shaped, "tokens_per_s": median_tokens_per_s(records),
                  "step_s": median_step_s(records), "steps": len(records),
                  "exposed_s": median_rank_stat(run_dir, "comm_exposed_s"), "compute_s": median_rank_stat(run_dir, "compute_s"),
                  "load_start": load_start, "load_end": loadavg()}
        if len(marks) == 2:
            (i0, wire0, cpu0), (i1, wire1, cpu1) = marks[WARMUP_ITERS], marks[steps - 1]
            result["cpu_per_step"] = {kind: (cpu1[kind] - cpu0[kind]) / (i1 - i0) for kind in CPU_KINDS}
            if wire0 is not None:
                result["wire_rx_per_step"] = (wire1[0] - wire0[0]) / (i1 - i0)
                result["wire_tx_per_step"] = (wire1[1] - wire0[1]) / (i1 - i0)
                result["wire_iters"] = (i0, i1)
        return result

    def calibrate_nodes(self, name: str, settings: tuple[str, ...] | None, out: Path, ranks_per_host: int = 1,
                        args: tuple[str, ...] = (), time_limit: float = 60.0) -> dict:
        """`trinity-train calibrate` started as the benchmark's job starts (`launch/local.sh` on this
        host for `settings` None, else `launch/multinode.sh` on both bed hosts with host 1's link
        shaped by `settings`), with COMMON and `args`; rank 0 writes the profile to `out`. Returns
        the wall seconds from start to the last launcher's exit and rank 0's output."""
        run_dir, head, env = self.next_job(name.split(":")[0])
        run_dir.mkdir(parents=True)
        command = ("calibrate", f"--out={out}", f"--time-limit={time_limit:g}", *COMMON, *args)
        logs: list[Path] = []
        start = time.monotonic()
        try:
            if settings is None:
                logs.append(run_dir / "local.log")
                with open(logs[0], "w") as log:
                    proc = subprocess.Popen(["launch/local.sh", str(2 * ranks_per_host), *command], cwd=ROOT,
                                            env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                self.local_procs.append(proc)
                procs = [proc]
            else:
                self.shape(settings)
                procs = []
                for i in (0, 1):
                    logs.append(run_dir / f"node{i}.log")
                    procs.append(self.bed.start(i, "launch/multinode.sh", "2", str(i), head, str(ranks_per_host), "--",
                                                *command, log=logs[-1], env=env))
            for proc in procs:
                try:
                    proc.wait(timeout=max(1.0, start + time_limit + JOB_TIMEOUT_S - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{name}: calibrate did not end\n" + tail(logs)) from None
                if proc.returncode != 0:
                    raise RuntimeError(f"{name}: calibrate exited {proc.returncode}\n" + tail(logs))
            seconds = time.monotonic() - start
        finally:
            if settings:
                self.bed.shape(1, "off")
        return {"seconds": seconds, "output": logs[0].read_text(), "profile": out}

    def kill_local(self) -> None:
        for proc in self.local_procs:
            stop_session(proc)


STOP_GRACE_S = 45  # torchrun's own grace for its workers is 30 s (then it kills them)


def stop_session(proc: subprocess.Popen) -> None:
    """Stop a launcher started in a session of its own, if it still runs: SIGTERM to the session
    (`launch/local.sh` passes it to torchrun, which stops the ranks it started in sessions of
    their own; a SIGKILL would leave those running), then SIGKILL if it has not ended in time."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def job_environment() -> dict:
    """Every job's environment: this interpreter's scripts on PATH, one OpenMP thread a process,
    passive waits unless OMP_WAIT_POLICY says otherwise."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def tail(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs if log.exists())


class RecoveryJob:
    def __init__(self, run_dir: Path, deadline: float):
        self.run_dir, self.deadline = run_dir, deadline

    def events(self) -> list[dict]:
        return read_jsonl(self.run_dir / "events.jsonl")

    def wait(self, predicate, what: str, interval: float = 0.25):
        return wait_for(predicate, self.deadline - time.monotonic(), interval, what)

    def checkpointed(self, step: int) -> bool:
        return any(e.get("event") == EventName.CHECKPOINT and e["step"] >= step for e in self.events())

    def restart_after(self, fault: float) -> dict | None:
        return next((e for e in self.events() if e.get("event") == EventName.RUN_START and e["time"] > fault), None)

    def trained_after(self, fault: float, count: int) -> bool:
        start = self.restart_after(fault)
        return start is not None and sum(1 for r in train_records(self.run_dir) if r["iter"] > start["iter"]) >= count

    def recovered(self, fault: float, what: str) -> dict:
        """Seconds from the fault to the restarted attempt's run_start and to its first trained
        step (polled every 0.25 s; the restarted attempt moves the records past its checkpoint
        out of metrics.jsonl before its run_start, so a later record is the restarted job's)."""
        start = self.wait(lambda: self.restart_after(fault), f"a restart after the {what}")
        self.wait(lambda: self.trained_after(fault, 1), f"a step after the {what}")
        return {"to_step_s": time.time() - fault, "to_run_start_s": start["time"] - fault,
                "resumed_from_step": start.get("step")}


CALIBRATION_MB = 16  # the tensor of each collective in the gloo calibration


def gloo_wire_rank(rank: int, head: str, out: str) -> None:
    """One rank of the calibration (run on a bed host): what gloo puts on this host's eth0 per
    collective, against the payload the counter credits it with."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{head}", rank=rank, world_size=2)
    n = CALIBRATION_MB * 2**20 // 4
    full, half = torch.ones(n), torch.ones(n // 2)
    out_full, out_half = torch.empty(n), torch.empty(n // 2)
    size = full.numel() * 4
    ops = {  # kind: (the collective, the bytes the counter credits this rank with)
        "all_gather": (lambda: dist.all_gather_single(out_full, half), size / 2),
        "reduce_scatter": (lambda: dist.reduce_scatter_single(out_half, full), size / 2),
        "all_reduce": (lambda: dist.all_reduce(full), size),
        "all_to_all": (lambda: dist.all_to_all_single(out_full, full), size / 2),
    }
    factors = {}
    for kind, (op, credited) in ops.items():
        op()
        dist.barrier()
        rx0, tx0 = wire_bytes(None)
        for _ in range(4):
            op()
        dist.barrier()
        rx1, tx1 = wire_bytes(None)
        factors[kind] = {"tx": (tx1 - tx0) / 4 / credited, "rx": (rx1 - rx0) / 4 / credited}
    dist.destroy_process_group()
    if rank == 1:
        Path(out).write_text(json.dumps(factors))


def calibrate(bench: Bench) -> dict:
    """{kind: {"tx", "rx"}}: bytes on host 1's eth0 per byte the collective counter credits, for each
    kind of collective on gloo between the bed's two hosts (`gloo_wire_rank` on each)."""
    run_dir, head, _ = bench.next_job("calibration")
    run_dir.mkdir(parents=True)
    out = run_dir / "factors.json"
    logs, procs = [], []
    for i in (0, 1):
        logs.append(run_dir / f"node{i}.log")
        code = f"from trinity_harness.jobs import gloo_wire_rank; gloo_wire_rank({i}, {head!r}, {str(out)!r})"
        procs.append(bench.bed.start(i, sys.executable, "-c", code, log=logs[-1], env={"GLOO_SOCKET_IFNAME": "eth0"}))
    deadline = time.monotonic() + 180
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError("the gloo calibration did not finish within 180 s\n" + tail(logs)) from None
        if proc.returncode != 0:
            raise RuntimeError(f"the gloo calibration failed ({proc.returncode})\n" + tail(logs))
    return json.loads(out.read_text())


def kind_of(category: str) -> str:
    """The collective behind a counter category (for the calibration's wire factor)."""
    if category in (FSDP_ALL_GATHER, MUON_REDISTRIBUTE):
        return "all_gather"
    # FSDP's reduce-scatter on gloo, the embedding's rows both ways, EP's tokens: all-to-alls
    if category in (FSDP_REDUCE_SCATTER, FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE, EP_ALL_TO_ALL):
        return "all_to_all"
    return category.removeprefix("other: ").split(" ")[0]



@contextlib.contextmanager
def bench_on_bed() -> Iterator[Bench]:
    """The bed's two hosts up and a `Bench` over them; every job and the bed taken down on exit,
    a signal (SIGINT, SIGTERM, SIGHUP: KeyboardInterrupt) included."""
    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # also where a shell left SIGINT ignored
        signal.signal(signum, stop)

    env = job_environment()
    work = Path(tempfile.mkdtemp(prefix="trinity-multinode-bench-"))
    bed = ClusterBed(2, PREFIX, SUBNET, env=env)
    bench = Bench(bed, work, env)
    try:
        bed.up()
        print(f"# bed: {bed.host(0)} {bed.addr(0)}, {bed.host(1)} {bed.addr(1)} (namespaces joined by a bridge)",
              flush=True)
        yield bench
    finally:
        bench.kill_local()
        bed.down()
        shutil.rmtree(work, ignore_errors=True)
