"""Two hosts of the cluster bed against one host: throughput over a shaped link, the bytes each
step moves per collective, and how long each fault takes to recover.

    python benchmarks/multinode.py [--rounds 2] [--steps 16] [--skip-throughput] [--skip-recovery]
                                   [--count-steps 10] [--recovery-steps 24] [--hsdp] [--ablation]
                                   [--where] [--bf16-wire] [--json PATH]

The default model (configs/debug.toml), FSDP x EP on 2 gloo ranks (`--parallel.ep=2`: the dense
weights sharded over both ranks, the routed experts split between them), global batch 8 x 256
tokens (micro-batch 4, no accumulation), constant learning rate, no validation, checkpoints or
layer statistics. Every rank runs one OpenMP thread (`OMP_NUM_THREADS=1`, passive waits), so all
conditions use the same two cores:

1. Throughput, in rounds of (a) 1 host x 2 ranks (`launch/local.sh 2`, loopback: the reference),
   (b) 2 bed hosts x 1 rank (`launch/multinode.sh` on each), link unshaped, (c) link shaped to
   1 Gbit/s (+ 1 ms delay each way where the kernel has netem), (d) 200 Mbit/s (+ 5 ms). The
   shaping is on host 1's link, both directions (`launch/cluster.sh shape`); with 2 hosts every
   byte between them crosses it. tokens/s is the median over the steps after the first
   `WARMUP_ITERS` of tokens / step_time_s; the ratio is to the same round's (a), and the summary
   gives each condition's median over the rounds against (a)'s. The bytes on the wire are host
   1's eth0 counters (`ip -n HOST -s -j link show eth0`) over those steps.
2. Bytes per step per collective: one more bed job (unshaped) whose ranks count every collective
   they issue (a TorchDispatchMode over the whole process, installed through a sitecustomize on
   PYTHONPATH, so the job is the same `launch/multinode.sh` command): the payload each rank sends
   to the other (all-gather: its shard x (n-1); reduce-scatter and all-reduce: (n-1)/n and
   2(n-1)/n of the tensor; all-to-all: the rows for other ranks), by kind, next to the theory
   from the model's sizes (`theory`). A calibration on the bed measures what gloo puts on the
   wire per credited byte of each kind (a 16 MiB tensor; FSDP's reduce-scatter takes the
   all-to-all's, which it is on gloo: parallel/gloo_reduce_scatter.py); payload x that factor
   must match the same steps' wire bytes within 5 %.
3. Recovery on the bed, 2 hosts x 1 rank, `--checkpoint.every=1 --parallel.collective_timeout_s=8`,
   one job with three faults in turn: node loss (every process of host 1 SIGKILLed, its launcher
   started again), partition (host 1's link down for 2 x the timeout, then up), frozen rank
   (SIGSTOP of host 1's worker). Each: seconds from the fault to the first step trained after it.
4. With --hsdp, the cluster-shaped layout: the same job on 4 ranks as HSDP 2 x 2 with EP inside
   each replica (`--parallel.dp_replicate=2 --parallel.dp_shard=2`, micro-batch 2 for the same
   global batch): 2 hosts x 2 ranks keep the shard and expert groups inside a host and only the
   replicas' all-reduce crosses the link (parallel/node_layout.py), against 1 host x 4 ranks, in
   rounds of the four conditions of 1. (`--skip-throughput --skip-recovery --hsdp` runs it alone.)
5. With --where, where the exposed communication sits: the 2-rank job on 1 host, at 1 Gbit/s, at
   200 Mbit/s, at 1 Gbit/s with the EP all-to-alls in one wave, and at 1 Gbit/s with every overlap
   off (and only the last block kept gathered into its backward), with every collective wait of
   each rank's training thread timed by the place that waits (`wait_sites.py`: an FSDP unit's
   all-gather, the reduce-scatters, the EP all-to-alls of the forward and the backward, Muon's
   exchange, the step's reductions), and what each shaped link added to each; beside them the
   machine's CPU seconds a step (user, system, softirq, idle from /proc/stat: the ranks of both
   hosts and the kernel's network work share its cores). (`--skip-throughput --skip-recovery
   --where` runs it alone.)
6. With --bf16-wire, rounds of the four conditions of 1 for the same job with both opt-in
   low-precision wires on (`--parallel.ep_wire_dtype=bf16 --parallel.reduce_wire_dtype=bf16`: half
   the bytes of the EP all-to-alls and the gradient reduce-scatters, one bf16 rounding each; not the
   default numerics), ratios to the same round's 1-host job with the same settings.
   (`--skip-throughput --skip-recovery --bf16-wire` runs it alone.)
7. With --ablation (after the rounds of 1), what each overlap setting buys: the 2-rank job on
   1 host and at 1 Gbit/s with every setting of `ABLATION` in turn (none of the overlaps, then the
   reduce-scatters overlapped, the all-gathers prefetched, the EP all-to-alls in waves, and the
   reshard policy's memory rule: the default), per round; ratios to the same round's 1-host job
   with the same settings. The changes that send fewer bytes have no setting to turn off; what
   they bought is measured across revisions in benchmarks/README.md §12.

The 2-rank job has one rank per host, so its expert groups span the hosts, which the launchers
refuse unless asked: it runs with `--parallel.allow_ep_tp_across_nodes=true` (`PAIR`).

Needs root and iproute2 (network namespaces). The bed is "tb" hosts at 10.218.0.x; traffic goes
only to loopback and the bed's own addresses. The bed is taken down on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
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

from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE,
                                            FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE)
from trinity_train.records import EventName

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
PREFIX, SUBNET = "tb", "10.218.0"
WARMUP_ITERS = 3
JOB_TIMEOUT_S = 600      # any throughput job
RECOVERY_TIMEOUT_S = 900  # the recovery job
COLLECTIVE_TIMEOUT_S = 8
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


# Sections 1-3: 2 ranks. One rank per host puts the expert groups across the link: asked for.
PAIR = Layout(1, ("--parallel.allow_ep_tp_across_nodes=true",), "1 host x 2 ranks", "2 hosts")
# Section 6 (--bf16-wire): the 2-rank job with both opt-in low-precision wires (DESIGN §4).
BF16_WIRE = ("--parallel.ep_wire_dtype=bf16", "--parallel.reduce_wire_dtype=bf16")
PAIR_BF16_WIRE = Layout(1, (*PAIR.args, *BF16_WIRE), "1 host x 2 ranks, bf16 wire", "2 hosts, bf16 wire")
# Section 4 (--hsdp): 4 ranks, HSDP 2 x 2, EP inside a replica; 2 per host keep both inside a host.
HSDP = Layout(2, ("--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.micro_batch_size=2"),
              "1 host x 4 ranks, HSDP", "2 hosts x 2 ranks, HSDP")
# The overlap settings the ablation turns on one by one (parallel/fsdp.py, parallel/expert_parallel.py),
# after none of them, and then the reshard policy's memory rule (parallel/reshard_policy.py).
ONE_EP_WAVE = "--parallel.ep_waves=1"
LAST_BLOCK_KEPT_ONLY = "--parallel.keep_gathered_gib=0"
OVERLAP_OFF = ("--parallel.overlap_reduce_scatter=false", "--parallel.prefetch_all_gather=false", ONE_EP_WAVE,
               LAST_BLOCK_KEPT_ONLY)
ABLATION = (
    ("no overlap", OVERLAP_OFF),
    ("+ reduce-scatter overlapped", ("--parallel.prefetch_all_gather=false", ONE_EP_WAVE, LAST_BLOCK_KEPT_ONLY)),
    ("+ all-gather prefetched", (ONE_EP_WAVE, LAST_BLOCK_KEPT_ONLY)),
    ("+ EP all-to-alls in waves", (LAST_BLOCK_KEPT_ONLY,)),
    ("+ blocks kept gathered within 1 GiB (default)", ()),
)
# (letter, what the name says of the link, shape settings; None: one host, loopback). Delays only
# where the kernel has netem.
CONDITIONS = (
    ("a", None, None),
    ("b", "unshaped", ()),
    ("c", "1 Gbit/1 ms", ("rate=1gbit", "delay=1ms")),
    ("d", "200 Mbit/5 ms", ("rate=200mbit", "delay=5ms")),
)
COUNTER_ENV = "TRINITY_BENCH_COLLECTIVES"
WAITS_ENV = "TRINITY_BENCH_WAITS"  # `wait_sites.install_wait_profiler`'s output folder (--where)


# --------------------------------------------------------------------------------------------
# The collective counter, run inside each training rank (see `sitecustomize_text`).

def install_collective_counter(out_dir: str) -> None:
    """Count the bytes this rank sends in every collective, per training iteration, into
    OUT_DIR/rank{RANK}.json (rewritten after every iteration), by the planner's rule
    (`trinity_train.plan.collectives`: the same bytes and categories a plan reports)."""
    from trinity_train.plan.collectives import CollectiveLog

    rank = os.environ.get("RANK", "0")
    path = Path(out_dir) / f"rank{rank}.json"
    counts: dict = {}
    log = CollectiveLog()

    def file_calls(key) -> None:
        """{category: [calls, bytes]} of the calls logged since the last filing, under `key`."""
        entry = counts.setdefault(str(key), {})
        for call in log.calls:
            tally = entry.setdefault(call.category, [0, 0])
            tally[0] += 1
            tally[1] += call.sent
        log.calls = []

    def dump() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        tmp.replace(path)

    import trinity_train.train as trainer_module

    original = trainer_module.Trainer.train_one_iteration

    def counted_iteration(self):
        file_calls("setup" if self.state.iteration == 0 else "between")
        try:
            return original(self)
        finally:
            file_calls(self.state.iteration)
            dump()

    trainer_module.Trainer.train_one_iteration = counted_iteration
    log.__enter__()  # for the rest of the process (its main thread)


def sitecustomize_text() -> str:
    """Installs, in a training rank, the collective counter or the wait profiler its job asks for."""
    return (
        "import os\n"
        f"if os.environ.get('RANK') is not None and os.environ.get({COUNTER_ENV!r}):\n"
        "    import sys\n"
        f"    sys.path.append({str(BENCH_DIR)!r})\n"
        "    import multinode\n"
        f"    multinode.install_collective_counter(os.environ[{COUNTER_ENV!r}])\n"
        f"if os.environ.get('RANK') is not None and os.environ.get({WAITS_ENV!r}):\n"
        "    import sys\n"
        f"    sys.path.append({str(BENCH_DIR)!r})\n"
        "    import wait_sites\n"
        f"    wait_sites.install_wait_profiler(os.environ[{WAITS_ENV!r}])\n"
    )


def instrumented_env(bench: Bench, env_name: str, out_dir: Path) -> dict:
    """The environment of a job whose ranks run the instrument `env_name` names, into `out_dir`
    (created), through the bench's sitecustomize."""
    out_dir.mkdir()
    site = bench.work / "site"
    if not site.exists():
        site.mkdir()
        (site / "sitecustomize.py").write_text(sitecustomize_text())
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {env_name: str(out_dir), "PYTHONPATH": pythonpath}


# --------------------------------------------------------------------------------------------
# The driver.

def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def read_records(path: Path) -> list[dict]:
    """Complete JSON lines of a file another process is appending to."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


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


def median_exposed_s(run_dir: Path) -> float | None:
    """Seconds per iteration the most-blocked rank waited in collectives (`comm_exposed_s` of the
    `ranks` records after the warm-up), the median over the reports; None without reports."""
    reports = [max(r["comm_exposed_s"]) for r in read_records(run_dir / "metrics.jsonl")
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
                  "step_s": median_step_s(records), "steps": len(records), "exposed_s": median_exposed_s(run_dir),
                  "load_start": load_start, "load_end": loadavg()}
        if len(marks) == 2:
            (i0, wire0, cpu0), (i1, wire1, cpu1) = marks[WARMUP_ITERS], marks[steps - 1]
            result["cpu_per_step"] = {kind: (cpu1[kind] - cpu0[kind]) / (i1 - i0) for kind in CPU_KINDS}
            if wire0 is not None:
                result["wire_rx_per_step"] = (wire1[0] - wire0[0]) / (i1 - i0)
                result["wire_tx_per_step"] = (wire1[1] - wire0[1]) / (i1 - i0)
                result["wire_iters"] = (i0, i1)
        return result

    def recovery(self, steps: int) -> dict:
        run_dir, head, env = self.next_job("recovery")
        env = {**env, "MAX_RESTARTS": "5"}
        args = (f"--train.steps={steps}", "--checkpoint.every=1",
                f"--parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S}")
        procs, logs = self.start_bed_job(run_dir, head, env, args)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        job = RecoveryJob(run_dir, deadline)
        result: dict = {"load_start": loadavg(), "steps": steps}
        try:
            job.wait(lambda: job.checkpointed(1), "the first checkpoint")

            fault = time.time()
            self.bed.kill_host(1)
            more, more_logs = self.start_bed_job(run_dir, head, env, args, index=1)
            procs.update(more)
            logs += more_logs
            result["node loss"] = job.recovered(fault, "node loss")
            job.wait(lambda: job.trained_after(fault, 2), "two steps after the node loss")

            fault = time.time()
            self.bed.partition(1)
            time.sleep(2 * COLLECTIVE_TIMEOUT_S)
            self.bed.heal(1)
            result["partition"] = job.recovered(fault, "partition")
            job.wait(lambda: job.trained_after(fault, 2), "two steps after the partition")

            fault = time.time()
            workers = self.bed.worker_pids(1)
            if not workers:
                raise RuntimeError("no worker process on host 1 to freeze")
            os.kill(workers[0], signal.SIGSTOP)  # torchrun SIGKILLs it after its SIGTERM grace
            result["frozen rank"] = job.recovered(fault, "frozen rank")

            for p in procs.values():
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            codes = {i: p.returncode for i, p in procs.items()}
            result["exit codes"] = codes
            from cluster_bed import surviving_train_records  # on sys.path once main() has run

            records = surviving_train_records(train_records(run_dir))
            result["finished_steps"] = len(records)
            result["step_s"] = median_step_s(records)
            result["restarts"] = sum(1 for e in job.events() if e.get("event") == EventName.RUN_START) - 1
        except Exception as e:
            raise RuntimeError(f"recovery: {e}\n{tail(logs)}") from e
        result["load_end"] = loadavg()
        return result

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
        return read_records(self.run_dir / "events.jsonl")

    def wait(self, predicate, what: str, interval: float = 0.25):
        while time.monotonic() < self.deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"{what} not reached before the recovery job's deadline")

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


# --------------------------------------------------------------------------------------------
# Bytes per step: counted on the ranks, on the wire, and from the parameter count.

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
    run_dir, head, _ = bench.next_job("calibration")
    run_dir.mkdir(parents=True)
    out = run_dir / "factors.json"
    logs, procs = [], []
    for i in (0, 1):
        logs.append(run_dir / f"node{i}.log")
        procs.append(bench.bed.start(i, sys.executable, str(Path(__file__).resolve()), "--gloo-wire-rank", str(i),
                                     "--gloo-wire-head", head, "--gloo-wire-out", str(out), log=logs[-1],
                                     env={"GLOO_SOCKET_IFNAME": "eth0"}))
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

def theory(overrides: tuple[str, ...], world: int) -> dict:
    """Bytes each rank sends per step, from the model's sizes (fp32, 2 ranks: every collective's
    group is both ranks or, for the experts' FSDP, one rank):

    - FSDP: every block is all-gathered in the forward and again in the backward (once if the
      reshard policy keeps it gathered, parallel/reshard_policy.py: the last block, those within
      `parallel.keep_gathered_gib`, or all with `--parallel.reshard_after_forward=false`; the
      root unit, final norm + head, once: it stays gathered after the forward; the embedding once:
      its backward does not read its weight, parallel/fsdp.py), and every unit's gradient
      reduce-scattered once; a rank sends (world-1)/world of the unit each time. The embedding's
      all-gather fetches only the rows its tokens read (parallel/embedding_gather.py) and its
      reduce-scatter sends only the rows they touched (parallel/embedding_rows.py): the theory of
      each is the whole table's, the most it can be. Routed experts are
      their own unit over dp_shard / ep ranks (1 here: no FSDP traffic).
    - EP: 4 token all-to-alls per MoE layer (dispatch and combine, forward and backward), each
      sending tokens x top_k x hidden x 4 B x (ep-1)/ep under uniform routing.
    - Muon: each FSDP-sharded matrix is assembled on its owner and its result sent back, packed in
      two all-to-alls (optim/muon_exchange.py): a rank sends its piece of each matrix it does not
      own and the other ranks' slices of each it owns, 2 (world-1)/world pieces a matrix on average.
    """
    import torch

    from trinity_train.config import default_config_path, load_config
    from trinity_train.model.transformer import TrinityModel
    from trinity_train.optim.groups import is_muon_param
    from trinity_train.parallel.reshard_policy import kept_gathered

    cfg = load_config(default_config_path(), list(overrides))
    with torch.device("meta"):
        model = TrinityModel(cfg.model)
    m, ep = cfg.model, cfg.parallel.ep
    efsdp = world // ep
    expert_ids = {id(p) for block in model.layers if ep > 1 and block.is_moe for p in block.mlp.experts.parameters()}

    def count(module, skip=()) -> int:
        skipped = {id(p) for sub in skip for p in sub.parameters()}
        return sum(p.numel() for p in module.parameters() if id(p) not in skipped and id(p) not in expert_ids)

    kept = kept_gathered([4 * sum(p.numel() / (ep if id(p) in expert_ids else 1) for p in block.parameters())
                          for block in model.layers],  # a rank's part: its own experts
                         cfg.parallel.keep_gathered_gib, cfg.parallel.reshard_after_forward)
    units = [(count(model.embed), 1)]
    units += [(count(block), 1 if keep else 2) for block, keep in zip(model.layers, kept)]
    units.append((count(model, [model.embed, *model.layers]), 1))
    share = (world - 1) / world
    gather = sum(p * 4 * share * times for p, times in units[1:])
    scatter = sum(p * 4 * share for p, _ in units[1:])
    embedding_rows = units[0][0] * 4 * share  # the whole table: the most its rows read or touched can be
    expert_params = sum(p.numel() for p in model.parameters() if id(p) in expert_ids)
    if efsdp > 1:  # (each block's experts gathered twice, or once where the block is kept)
        gather += sum(sum(p.numel() for p in block.parameters() if id(p) in expert_ids) * (1 if keep else 2)
                      for block, keep in zip(model.layers, kept)) * 4 * (efsdp - 1) / efsdp
        scatter += expert_params * 4 * (efsdp - 1) / efsdp
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    moe_layers = m.num_layers - m.num_dense_layers
    all_to_all = 4 * moe_layers * tokens * m.num_experts_per_tok * m.hidden_size * 4 * (ep - 1) / ep
    muon = sum(p.numel() * 4 for name, p in model.named_parameters()
               if is_muon_param(name, cfg.optim.muon_router) and id(p) not in expert_ids) * 2 * share / world
    return {FSDP_ALL_GATHER: gather, FSDP_REDUCE_SCATTER: scatter, FSDP_EMBEDDING_ROWS_GATHER: embedding_rows,
            FSDP_EMBEDDING_ROWS_REDUCE: embedding_rows, EP_ALL_TO_ALL: all_to_all,
            MUON_REDISTRIBUTE: muon, "params": sum(p.numel() for p in model.parameters()),
            "sharded_params": sum(p for p, _ in units), "expert_params": expert_params, "tokens_per_rank": tokens}


def rank_iterations(out_dir: Path, name: str, first: int, last: int) -> list[list[dict]]:
    """Per rank of the 2-rank job: the per-iteration tables its instrument wrote to
    OUT_DIR/{name}{rank}.json ({iteration: table}, and the counter's "setup": what came before the
    first iteration), iterations `first` to `last`."""
    per_rank = []
    for rank in (0, 1):
        data = json.loads((out_dir / f"{name}{rank}.json").read_text())
        per_rank.append([table for it, table in data.items() if it.isdigit() and first <= int(it) <= last])
    return per_rank


def count_job(bench: Bench, steps: int) -> dict:
    counter_dir = bench.work / "collectives"
    result = bench.throughput_job(PAIR.condition("count", "unshaped, counting"), (), steps,
                                  extra_env=instrumented_env(bench, COUNTER_ENV, counter_dir))
    i0, i1 = result["wire_iters"]
    per_rank = []
    for window in rank_iterations(counter_dir, "rank", i0 + 1, i1):
        kinds = sorted({k for it in window for k in it})
        per_rank.append({k: {"calls": sum(it.get(k, [0, 0])[0] for it in window) / len(window),
                             "bytes": sum(it.get(k, [0, 0])[1] for it in window) / len(window)} for k in kinds})
    result["per_rank"] = per_rank
    return result


def where_jobs(bench: Bench, steps: int) -> list[dict]:
    """The 2-rank job with every rank's collective waits timed by the place that waits
    (`wait_sites.py`) on 1 host (condition a), at 1 Gbit/s (c), at 200 Mbit/s (d), at 1 Gbit/s
    with the EP all-to-alls in one wave, and at 1 Gbit/s with no overlap (`OVERLAP_OFF`): each row
    gets, per rank, the median seconds per iteration at each site over the iterations after the
    warm-up."""
    (a, a_link, a_shape), (c, c_link, c_shape), (d, d_link, d_shape) = CONDITIONS[0], CONDITIONS[2], CONDITIONS[3]
    rows = []
    for name, shape, extra in ((PAIR.condition(a, a_link), a_shape, ()), (PAIR.condition(c, c_link), c_shape, ()),
                               (PAIR.condition(d, d_link), d_shape, ()),
                               (PAIR.condition(c, c_link + ", one EP wave"), c_shape, (ONE_EP_WAVE,)),
                               (PAIR.condition(c, c_link + ", no overlap"), c_shape, OVERLAP_OFF)):
        waits_dir = bench.work / f"waits-{len(rows)}"
        row = bench.throughput_job(name, shape, steps, extra_env=instrumented_env(bench, WAITS_ENV, waits_dir),
                                   extra_args=extra)
        row["waits"] = []
        for iters in rank_iterations(waits_dir, "waits", WARMUP_ITERS + 1, steps):
            sites = {site for it in iters for site in it}
            row["waits"].append({site: statistics.median(it.get(site, [0, 0.0])[1] for it in iters)
                                 for site in sites})
        rows.append(row)
    return rows


def report_where(rows: list[dict]) -> list[str]:
    """The table of `where_jobs`: seconds a step each rank waited at each site on one host, at
    1 Gbit/s and at 200 Mbit/s with what each link added (the ranks' mean), and at 1 Gbit/s in one
    EP wave and without overlap."""
    from wait_sites import ITERATION_WALL

    one_host, gbit, slow, *others = rows
    sites = {site for row in rows for waits in row["waits"] for site in waits} - {ITERATION_WALL}

    def mean(row: dict, site: str) -> float:
        return statistics.mean(waits.get(site, 0.0) for waits in row["waits"])

    def cell(row: dict, site: str) -> str:
        return " / ".join(f"{waits.get(site, 0.0):.3f}" for waits in row["waits"])

    lines = [f"where the ranks wait (seconds a step, median over steps {WARMUP_ITERS + 1}-{one_host['steps']}; "
             f"rank 0 / rank 1; load {one_host['load_start']} -> {rows[-1]['load_end']})",
             f"| site | {one_host['condition']} | {gbit['condition']} | added by 1 Gbit/s (mean of the ranks) | "
             f"{slow['condition']} | added by 200 Mbit/s | " + " | ".join(row["condition"] for row in others) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(others)]

    def line(label: str, values: list[str], by_row: list[float]) -> str:
        """One row of the table; `by_row` (a figure per condition) gives what each link added."""
        gbit_added, slow_added = by_row[1] - by_row[0], by_row[2] - by_row[0]
        return (f"| {label} | {values[0]} | {values[1]} | {gbit_added:+.3f} | {values[2]} | {slow_added:+.3f} | "
                + " | ".join(values[3:]) + " |")

    for site in sorted(sites, key=lambda s: -(mean(slow, s) - mean(one_host, s))):
        lines.append(line(site, [cell(row, site) for row in rows], [mean(row, site) for row in rows]))

    def figures(label: str, by_row: list[float]) -> None:
        lines.append(line(label, [f"{x:.3f}" for x in by_row], by_row))

    figures("all sites (sum of the medians, mean of the ranks)",
            [sum(mean(row, site) for site in sites) for row in rows])
    figures("the iteration", [mean(row, ITERATION_WALL) for row in rows])
    if all("cpu_per_step" in row for row in rows):  # the machine's, both hosts' ranks and the kernel together
        for kind in CPU_KINDS:
            figures(f"machine CPU s a step: {kind}", [row["cpu_per_step"][kind] for row in rows])
    return lines


def mb(x: float) -> str:
    return f"{x / 1e6:,.2f}"


def report_bytes(counted: dict, sizes: dict, factors: dict, step_s: float, wire_rows: list[dict]) -> list[str]:
    lines = [("gloo on the bed, bytes on host 1's eth0 per byte the counter credits (a "
              f"{CALIBRATION_MB} MiB tensor, 4 calls each; ideal algorithms would give 1.00):")]
    lines.append("  " + ", ".join(f"{kind} {f['tx']:.2f}" for kind, f in factors.items()))
    i0, i1 = counted["wire_iters"]
    lines.append(f"bytes per step, iterations {i0 + 1}-{i1} of the counting job (2 hosts x 1 rank, unshaped; "
                 "MB = 1e6 B): each rank's payload to the other, counted in the ranks; x the gloo factor = the "
                 "wire it should take")
    kinds = sorted({k for r in counted["per_rank"] for k in r},
                   key=lambda k: (not k.startswith("FSDP"), not k.startswith("EP"), not k.startswith("Muon"), k))
    lines.append(f"  {'collective':<36} {'calls':>5} {'theory':>8} {'rank 0':>8} {'rank 1':>8} {'x gloo':>6} "
                 f"{'wire':>8}")
    counted_sum, expected = [0.0, 0.0], [0.0, 0.0]
    for kind in kinds:
        calls = max(r.get(kind, {"calls": 0})["calls"] for r in counted["per_rank"])
        sent = [r.get(kind, {"bytes": 0})["bytes"] for r in counted["per_rank"]]
        factor = factors.get(kind_of(kind), {"tx": 1.0})["tx"]
        counted_sum = [t + x for t, x in zip(counted_sum, sent)]
        expected = [t + x * factor for t, x in zip(expected, sent)]
        th = sizes.get(kind)
        lines.append(f"  {kind:<36} {calls:>5.0f} {mb(th) if th is not None else '':>8} {mb(sent[0]):>8} "
                     f"{mb(sent[1]):>8} {factor:>6.2f} {mb(max(sent) * factor):>8}")
    lines.append(f"  {'all collectives':<36} {'':>5} {'':>8} {mb(counted_sum[0]):>8} {mb(counted_sum[1]):>8} "
                 f"{'':>6} {mb(max(expected)):>8}")
    rx, tx = counted["wire_rx_per_step"], counted["wire_tx_per_step"]
    ok = all(abs(w / e - 1) <= 0.05 for w, e in ((rx, expected[0]), (tx, expected[1])))
    lines.append(f"  measured on host 1's eth0: rx {mb(rx)} (from rank 0), tx {mb(tx)} (from rank 1) = "
                 f"{rx / expected[0]:.3f} and {tx / expected[1]:.3f} x the expected wire bytes "
                 f"({'within' if ok else 'OUTSIDE'} the 5 % margin); {rx / counted_sum[0]:.2f} x the payload")
    if wire_rows:
        per_step = [r["wire_tx_per_step"] for r in wire_rows] + [r["wire_rx_per_step"] for r in wire_rows]
        lines.append(f"  the throughput jobs on the bed: {mb(min(per_step))}-{mb(max(per_step))} MB per step "
                     "and direction (rx and tx, every shaping)")
    wire = max(rx, tx)
    for rate, label in ((125e6, "1 Gbit/s"), (25e6, "200 Mbit/s")):
        lines.append(f"  at {label} ({rate / 1e6:.0f} MB/s): {mb(wire)} MB / step = {wire / rate:.2f} s on the wire per "
                     f"direction, against a {step_s:.2f} s single-host step: ratio {step_s / (step_s + wire / rate):.2f} "
                     f"if nothing overlaps, 1.00 if all of it does")
    return lines


# --------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four throughput conditions")
    parser.add_argument("--steps", type=int, default=16, help="steps per throughput job")
    parser.add_argument("--count-steps", type=int, default=10, help="steps of the collective-counting job")
    parser.add_argument("--recovery-steps", type=int, default=24, help="steps of the recovery job")
    parser.add_argument("--skip-throughput", action="store_true", help="no throughput or bytes-per-step jobs")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--hsdp", action="store_true",
                        help="also run the rounds of 4 ranks, HSDP 2 x 2: 2 hosts x 2 ranks against 1 host x 4")
    parser.add_argument("--ablation", action="store_true",
                        help="the overlap settings one by one, on 1 host x 2 ranks and at 1 Gbit/s, per round")
    parser.add_argument("--where", action="store_true",
                        help="time every collective wait by where it waits: 1 host, 1 Gbit/s, 200 Mbit/s, "
                             "1 Gbit/s in one EP wave, 1 Gbit/s without overlap")
    parser.add_argument("--bf16-wire", action="store_true",
                        help="also run the rounds with the opt-in bf16 wire (parallel.ep_wire_dtype and "
                             "parallel.reduce_wire_dtype = bf16)")
    parser.add_argument("--json", help="write every figure to this file")
    for hidden in ("--gloo-wire-rank", "--gloo-wire-head", "--gloo-wire-out"):  # one rank of the calibration
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gloo_wire_rank is not None:
        gloo_wire_rank(int(args.gloo_wire_rank), args.gloo_wire_head, args.gloo_wire_out)
        return 0
    if args.steps <= WARMUP_ITERS + 2 or args.count_steps <= WARMUP_ITERS + 2:
        parser.error(f"--steps and --count-steps must be above {WARMUP_ITERS + 2} (the first {WARMUP_ITERS} are warm-up)")

    reason = bed_unavailable()
    if reason is not None:
        print(f"benchmarks/multinode.py: {reason}", file=sys.stderr)
        return 2
    print(f"# load: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    print(f"# train args: {' '.join(COMMON + PAIR.args)} (default model, configs/debug.toml; OMP_NUM_THREADS=1 "
          "per rank)")
    out: dict = {"load_start": Path("/proc/loadavg").read_text().strip(), "args": vars(args), "common": COMMON}
    try:
        with bench_on_bed() as bench:
            bench_body(bench, args, out)
    except KeyboardInterrupt as e:
        print(f"benchmarks/multinode.py: interrupted ({e or 'SIGINT'}); the bed and every job are taken down",
              file=sys.stderr)
        return 130
    out["load_end"] = Path("/proc/loadavg").read_text().strip()
    print(f"# load after: {out['load_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def bed_unavailable() -> str | None:
    """Why the cluster bed cannot be brought up here (no root, no iproute2), or None."""
    sys.path.insert(0, str(ROOT / "tests"))  # the cluster bed's Python wrapper
    from cluster_bed import bed_unavailable as reason

    return reason()


@contextlib.contextmanager
def bench_on_bed() -> Iterator[Bench]:
    """The bed's two hosts up and a `Bench` over them; every job and the bed taken down on exit,
    a signal (SIGINT, SIGTERM, SIGHUP: KeyboardInterrupt) included."""
    sys.path.insert(0, str(ROOT / "tests"))
    from cluster_bed import ClusterBed

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


def throughput_rounds(bench: Bench, layout: Layout, rounds: int, steps: int) -> list[dict]:
    """`rounds` rounds of the four conditions of `layout`'s job, each row printed as it ends, then
    the tables."""
    rows = []
    names = [layout.condition(letter, shaped) for letter, shaped, _ in CONDITIONS]
    width = max(27, *map(len, names))
    for rnd in range(1, rounds + 1):
        for name, (_, _, settings) in zip(names, CONDITIONS):
            row = bench.throughput_job(name, settings, steps, layout=layout)
            row["round"] = rnd
            rows.append(row)
            ref = next(r for r in rows if r["round"] == rnd and r["shaping"] == "loopback")
            row["ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
            wire = (f"  wire/step rx {mb(row['wire_rx_per_step'])} MB tx {mb(row['wire_tx_per_step'])} MB"
                    if "wire_rx_per_step" in row else "")
            print(f"round {rnd} {name:<{width}} shaping {row['shaping']:<12} {row['tokens_per_s']:>7,.0f} tokens/s "
                  f"step {row['step_s']:.2f} s (exposed comm {exposed(row)})  ratio {row['ratio']:.2f}  load "
                  f"{row['load_start']} -> {row['load_end']}{wire}", flush=True)
    if bench.netem is False:
        print(f"# note: delays not shaped: {bench.shape_note}")
    print()
    print("| round | condition | link shaped (host 1, both directions) | tokens/s | step s | exposed comm s | "
          "ratio to a | load start -> end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['condition']} | {r['shaping']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.2f} | "
              f"{exposed(r)} | {r['ratio']:.2f} | {r['load_start']} -> {r['load_end']} |")
    print()
    # The one-host reference moves the most from round to round on a shared machine, so beside each
    # round's ratio the medians' ratio: each condition's median over the rounds against a's.
    print("| condition | median tokens/s over rounds | its ratio to a's median | ratios to a, per round |")
    print("|---|---|---|---|")
    medians = {name: statistics.median(r["tokens_per_s"] for r in rows if r["condition"] == name) for name in names}
    for name in names:
        mine = [r for r in rows if r["condition"] == name]
        print(f"| {name} | {medians[name]:,.0f} | {medians[name] / medians[names[0]]:.2f} | "
              f"{', '.join(format(r['ratio'], '.2f') for r in mine)} |")
    print(flush=True)
    return rows


def bench_body(bench: Bench, args, out: dict) -> None:
    """The throughput rounds, the bytes per step, the recovery drills and the HSDP rounds, printed
    and put in `out`."""
    if not args.skip_throughput:
        rows = throughput_rounds(bench, PAIR, args.rounds, args.steps)
        out["throughput"] = rows
        out["netem"] = bench.netem
        out["shape_note"] = bench.shape_note

        if args.ablation:
            out["ablation"] = ablation(bench, args)
        factors = calibrate(bench)
        counted = count_job(bench, args.count_steps)
        sizes = theory(COMMON, 2)
        print(f"# model: {sizes['params']:,} parameters: {sizes['sharded_params']:,} in FSDP units (sharded over "
              f"the 2 ranks), {sizes['expert_params']:,} routed-expert weights (split by EP, not sharded); "
              f"{sizes['tokens_per_rank']} tokens per rank and step")
        ref_step = statistics.median(r["step_s"] for r in rows if r["shaping"] == "loopback")
        for line in report_bytes(counted, sizes, factors, ref_step, [r for r in rows if "wire_tx_per_step" in r]):
            print(line)
        print(f"  (the counting job: {counted['tokens_per_s']:,.0f} tokens/s with the counter's overhead; not a "
              "throughput figure)")
        out.update(collectives=counted, theory=sizes, gloo_factors=factors)
        print(flush=True)
    if args.where:
        rows = where_jobs(bench, args.steps)
        for line in report_where(rows):
            print(line)
        print(flush=True)
        out["where"] = rows
    if not args.skip_recovery:
        rec = bench.recovery(args.recovery_steps)
        print(f"recovery, 2 hosts x 1 rank, --checkpoint.every=1 --parallel.collective_timeout_s="
              f"{COLLECTIVE_TIMEOUT_S} --train.steps={args.recovery_steps}, MAX_RESTARTS=5 "
              f"(load {rec['load_start']} -> {rec['load_end']}; median step {rec['step_s']:.2f} s)")
        waits = {  # what the fault itself makes everyone wait, before any restart can begin
            "node loss": (0, ("none: the killed rank's sockets close and rank 0 fails at once; the rest is the "
                              "new launcher's start, the rendezvous, worker start and restore")),
            "partition": (2 * COLLECTIVE_TIMEOUT_S, (f"the link's {2 * COLLECTIVE_TIMEOUT_S} s down (the ranks time "
                                                     f"out after {COLLECTIVE_TIMEOUT_S} s; the rendezvous needs host 1 "
                                                     "back)")),
            "frozen rank": (COLLECTIVE_TIMEOUT_S + 30, (f"the {COLLECTIVE_TIMEOUT_S} s collective timeout + torchrun's "
                                                        "30 s SIGTERM grace before it SIGKILLs the stopped worker")),
        }
        print(f"  {'fault':<12} {'-> run_start':>12} {'-> next step':>12} {'fixed wait':>10} {'restart':>8}  "
              "resumed at  the fixed wait")
        for fault in ("node loss", "partition", "frozen rank"):
            r = rec[fault]
            wait_s, why = waits[fault]
            r["fixed_wait_s"] = wait_s
            print(f"  {fault:<12} {r['to_run_start_s']:>10.1f} s {r['to_step_s']:>10.1f} s {wait_s:>8.0f} s "
                  f"{r['to_step_s'] - wait_s:>6.1f} s  step {r['resumed_from_step']!s:<6} {why}")
        print(f"  the job finished {rec['finished_steps']} / {args.recovery_steps} steps after {rec['restarts']} restarts, "
              f"exit codes {rec['exit codes']}")
        out["recovery"] = rec
    if args.bf16_wire:
        print(f"# the opt-in low-precision wire: {' '.join(BF16_WIRE)} (not the default "
              "numerics: one bf16 rounding of what the EP all-to-alls and the gradient reduce-scatters send)")
        out["bf16_wire_throughput"] = throughput_rounds(bench, PAIR_BF16_WIRE, args.rounds, args.steps)
    if args.hsdp:
        print(f"# HSDP 2 x 2 with EP inside a replica: {' '.join(HSDP.args)}; 2 hosts x 2 ranks keep shard and "
              "expert groups inside a host, the replicas' all-reduce crosses the link")
        out["hsdp_throughput"] = throughput_rounds(bench, HSDP, args.rounds, args.steps)


def ablation(bench: Bench, args) -> list[dict]:
    """What each overlap setting buys: every `ABLATION` variant on 1 host x 2 ranks (a one host
    must not get slower) and at 1 Gbit/s, per round; ratios to the same round's 1-host job with
    the same settings."""
    rows = []
    for rnd in range(1, args.rounds + 1):
        for variant, extra in ABLATION:
            (a, a_link, a_shape), (c, c_link, c_shape) = CONDITIONS[0], CONDITIONS[2]
            local = bench.throughput_job(PAIR.condition(a, a_link), a_shape, args.steps, extra_args=extra)
            gbit = bench.throughput_job(PAIR.condition(c, c_link), c_shape, args.steps, extra_args=extra)
            row = {"round": rnd, "variant": variant, "settings": list(extra), "one_host": local, "1gbit": gbit,
                   "ratio": gbit["tokens_per_s"] / local["tokens_per_s"]}
            rows.append(row)
            print(f"ablation round {rnd} {variant:<34} 1 host {local['tokens_per_s']:>7,.0f} tokens/s  "
                  f"1 Gbit {gbit['tokens_per_s']:>7,.0f} tokens/s (step {gbit['step_s']:.2f} s, exposed comm "
                  f"{exposed(gbit)} s)  ratio {row['ratio']:.2f}  load {local['load_start']} -> {gbit['load_end']}",
                  flush=True)
    print()
    print("| overlap | 1 host x 2 ranks tokens/s | 2 hosts at 1 Gbit tokens/s | step s at 1 Gbit | exposed comm s "
          "at 1 Gbit | ratio |")
    print("|---|---|---|---|---|---|")
    for variant, _ in ABLATION:
        mine = [r for r in rows if r["variant"] == variant]
        cells = [", ".join(fmt(r) for r in mine) for fmt in (
            lambda r: format(r["one_host"]["tokens_per_s"], ",.0f"), lambda r: format(r["1gbit"]["tokens_per_s"], ",.0f"),
            lambda r: format(r["1gbit"]["step_s"], ".2f"), lambda r: exposed(r["1gbit"]), lambda r: format(r["ratio"], ".2f"))]
        print(f"| {variant} | {' | '.join(cells)} |")
    print(flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
