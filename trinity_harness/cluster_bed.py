"""The cluster bed (`launch/cluster.sh`) from Python, for the multi-node tests and benchmark.

`ClusterBed` makes N namespace hosts, starts launchers on them, cuts and shapes their links, and
always takes everything down (`with ClusterBed(...)`, or `down()` in a `finally`). Each bed has its
own name prefix and /24 so that beds of several test files or a user's rehearsal never meet.
`bed_unavailable()` says why a bed cannot be made here (not root, no iproute2); CI must have one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "cluster.sh"
SLURM_DAEMONS = ("slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged")


def bed_unavailable() -> str | None:
    """Why no bed can be made on this machine, or None."""
    if os.geteuid() != 0:
        return "the cluster bed needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the cluster bed needs {', '.join(missing)} (apt-get install -y iproute2 util-linux)"
    return None


class ClusterBed:
    """N hosts `<prefix>node0..` at `<subnet>.1..`; see launch/cluster.sh."""

    def __init__(self, hosts: int, prefix: str, subnet: str, env: dict | None = None):
        self.count = hosts
        self.prefix = prefix
        self.subnet = subnet
        self.env = {**(env or os.environ), "TRINITY_CLUSTER_PREFIX": prefix,
                    "TRINITY_CLUSTER_SUBNET": subnet}
        self.procs: list[subprocess.Popen] = []

    def host(self, index: int) -> str:
        return f"{self.prefix}node{index}"

    def addr(self, index: int) -> str:
        return f"{self.subnet}.{index + 1}"

    def _script(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def up(self) -> "ClusterBed":
        self.down()  # a bed a crashed run left behind
        done = self._script("up", str(self.count))
        if done.returncode != 0:
            raise RuntimeError(f"cluster.sh up failed: {done.stderr.strip()}")
        return self

    def down(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self._script("down")

    def __enter__(self) -> "ClusterBed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def run(self, index: int, *cmd: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), "exec", self.host(index), *cmd], env={**self.env, **(env or {})},
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def start(self, index: int, *cmd: str, log: Path, env: dict | None = None) -> subprocess.Popen:
        """CMD on host `index` in the background (its own process group), output to `log`."""
        with open(log, "w") as out:
            proc = subprocess.Popen([str(SCRIPT), "exec", self.host(index), *cmd], env={**self.env, **(env or {})},
                                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, index: int) -> list[int]:
        """Every process in host `index`'s network namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.host(index)], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def worker_pids(self, index: int) -> list[int]:
        """The training ranks on host `index` (`python -m trinity_train.cli train`), not their
        torchrun agent, whose command line names the module too."""
        found = []
        for pid in self.pids(index):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # ended meanwhile
            if b"trinity_train.cli" in cmdline and b"torchrun" not in cmdline:
                found.append(pid)
        return found

    def kill_host(self, index: int) -> None:
        """A node lost: every process of host `index` SIGKILLed at once."""
        for pid in self.pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def partition(self, index: int) -> None:
        self._check(self._script("partition", self.host(index)))

    def heal(self, index: int) -> None:
        self._check(self._script("heal", self.host(index)))

    def wire_bytes(self, index: int) -> tuple[int, int]:
        """(received, sent) bytes so far on host `index`'s link (its eth0 counters)."""
        done = subprocess.run(["ip", "-n", self.host(index), "-s", "-j", "link", "show", "eth0"],
                              capture_output=True, text=True, timeout=10, check=True)
        stats = json.loads(done.stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def shape(self, index: int, *settings: str) -> subprocess.CompletedProcess:
        return self._script("shape", self.host(index), *settings)

    @staticmethod
    def _check(done: subprocess.CompletedProcess) -> None:
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())


def surviving_train_records(records: list[dict]) -> list[dict]:
    """The training record that survived for each step, in step order: a step re-done after a
    restart from an older checkpoint appears twice, and the later one is the run's."""
    by_step = {r["step"]: r for r in records if r.get("kind") == "train"}
    return [by_step[s] for s in sorted(by_step)]


def leftovers(prefix: str) -> list[str]:
    """What a bed with `prefix` left behind: namespaces, hosts files, its state directory."""
    found = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found += [f"netns {n.split()[0]}" for n in names if n.strip() and n.split()[0].startswith(prefix)]
    netns_etc = Path("/etc/netns")
    if netns_etc.is_dir():
        found += [f"/etc/netns/{p.name}" for p in netns_etc.iterdir() if p.name.startswith(prefix)]
    state = Path(f"/run/trinity-cluster-{prefix}")
    if state.exists():
        found.append(str(state))
    return found


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
    """Poll `predicate` until it returns something truthy, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout:.0f} s")


def slurm_unavailable() -> str | None:
    """Why SLURM cannot run on a bed here, or None."""
    if os.geteuid() != 0:
        return "the SLURM bed needs root (network namespaces, daemons)"
    for tools, package in ((("ip", "tc", "nsenter", "unshare"), "iproute2 util-linux"),
                           (("slurmctld", "slurmd", "sbatch", "munged", "munge"), "slurm-wlm munge")):
        missing = [tool for tool in tools if shutil.which(tool) is None]
        if missing:
            return f"the SLURM bed needs {', '.join(missing)} (apt-get install -y {package})"
    return None


class SlurmBed:
    """Two bed hosts with SLURM on them; the clients run on host 0, where slurmctld listens."""

    def __init__(self, prefix: str, subnet: str, env: dict, job_timeout: float):
        self.prefix, self.head, self.job_timeout = prefix, f"{prefix}node0", job_timeout
        self.state = Path(f"/run/trinity-cluster-{prefix}")
        self.env = {**env, "TRINITY_CLUSTER_PREFIX": prefix, "TRINITY_CLUSTER_SUBNET": subnet,
                    "SLURM_CONF": str(self.state / "slurm" / "slurm.conf")}
        self.env.pop("TRINITY_CLUSTER_STATE", None)

    def script(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        done = subprocess.run([str(a) for a in args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(map(str, args))}: {done.stderr[-2000:]}"
        return done

    def up(self) -> None:
        self.down()  # a bed a crashed run left behind
        self.script("launch/cluster.sh", "up", "2")
        exported = self.script("launch/cluster_slurm.sh", "up").stdout.strip()
        assert exported == f"export SLURM_CONF={self.env['SLURM_CONF']}", exported

    def down(self) -> None:
        subprocess.run(["launch/cluster.sh", "down"], cwd=ROOT, env=self.env, capture_output=True, timeout=120)

    def client(self, *cmd: str) -> str:
        return self.script("launch/cluster.sh", "exec", self.head, *cmd, timeout=30).stdout

    def submit(self, out: Path, *train_args: str) -> str:
        return self.client("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                           "--cpus-per-task=1", f"--output={out}", "launch/slurm.sbatch", *train_args).strip()

    def job(self, job_id: str) -> dict[str, str]:
        fields = self.client("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait_ended(self, job_id: str, out: Path) -> dict[str, str]:
        deadline = time.monotonic() + self.job_timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return job
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} did not end within {self.job_timeout} s: {self.job(job_id)['JobState']}; "
                           f"its output: {out.read_text()[-2000:] if out.exists() else '(none)'}")

    def daemon_pids(self) -> set[int]:
        """The SLURM and munge daemons of this bed: those whose command line or environment names
        its state directory (SLURM_CONF, munged's socket)."""
        found = set()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "comm").read_text().strip() in SLURM_DAEMONS:
                    if str(self.state).encode() in (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes():
                        found.add(int(proc.name))
            except OSError:  # ended meanwhile
                continue
        return found
