"""Running the `prepare-data` pipeline on a datatrove executor: local processes, SLURM array jobs,
or a Ray cluster. Every executor runs the same tasks and datatrove's completion markers (one file
per finished task in the logging directory) say which are done, so a rerun runs only the rest and
the result does not depend on which executor, or how many workers, ran a task."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trinity_train.data.worker_death import children_die_with_this_process
from trinity_train.errors import ConfigError, DataError

EXECUTORS = ("local", "slurm", "ray")
_ALIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}
_POLL_SECONDS = 2.0


class TasksUnfinished(DataError):
    """The pipeline stopped with tasks not done: not a refusal of the inputs, so what the run wrote
    stays for the rerun (which runs only those tasks), and the message points into it."""


@dataclass
class ExecutorOptions:
    executor: str = "local"
    tasks: int = 1
    workers: int = 0  # tasks at once; 0: local: min(tasks, CPUs), slurm/ray: no limit
    slurm_partition: str = ""
    slurm_time: str = "24:00:00"
    cpus_per_task: int = 1  # slurm and ray: CPUs (and with the next, memory) reserved for a task
    mem_per_cpu_gb: int = 2
    ray_address: str = ""  # "" starts a local Ray (ray.init()); else the address of a running cluster


def check_executor_options(o: ExecutorOptions) -> None:
    if o.executor not in EXECUTORS:
        raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}, got '{o.executor}'")
    if o.tasks < 1 or o.workers < 0 or o.cpus_per_task < 1 or o.mem_per_cpu_gb < 1:
        raise ConfigError("--tasks, --cpus-per-task and --mem-per-cpu-gb must be positive and --workers at "
                          "least 0 (0: as many as fit)")
    if o.executor == "slurm" and shutil.which("sbatch") is None:
        raise ConfigError("--executor slurm needs SLURM's sbatch on PATH (run prepare-data on a login node "
                          "of the cluster), or use --executor local")
    if o.executor == "slurm":
        _check_partition(o.slurm_partition)
    if o.executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--executor ray needs ray: pip install 'trinity-train[ray]'") from None


def _check_partition(partition: str) -> None:
    """SLURM answers and has the partition (sbatch's own failure would print several lines)."""
    done = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"--executor slurm: SLURM does not answer here (sinfo: {last}); run prepare-data "
                          "where sbatch can reach the cluster's controller")
    partitions = done.stdout.split()
    if partition not in partitions:
        raise ConfigError(f"--executor slurm needs --slurm-partition NAME, one of {', '.join(partitions) or 'none'}"
                          f"{f'; got {partition!r}' if partition else ''}")


def run_pipeline(pipeline: list, o: ExecutorOptions, logging_dir: Path, name: str, progress: bool) -> None:
    """Run every task not yet completed; returns once all are, or raises one clear error."""
    if o.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        workers = min(o.workers or os.cpu_count() or 1, o.tasks)
        if workers > 1:  # one tokenizer thread per worker process, not a pool each
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # fork, not datatrove's forkserver: a worker starts with this process's imports (torch's
        # among them) instead of importing them again, seconds per worker; the tasks use no
        # threads the parent started (TOKENIZERS_PARALLELISM above).
        executor = LocalPipelineExecutor(pipeline, tasks=o.tasks, workers=workers, logging_dir=str(logging_dir),
                                         start_method="fork")
        # Local only: SLURM's tasks are the cluster's jobs, meant to outlive this process (a rerun
        # finds them done), and Ray's workers are Ray's, which ray.shutdown and Ray's own
        # processes end.
        with children_die_with_this_process():
            executor.run()
    elif o.executor == "slurm":
        executor = _slurm_executor(pipeline, o, logging_dir, name)
        try:
            executor.run()  # submits the array job (nothing when every task is already complete)
        except subprocess.CalledProcessError as e:
            raise TasksUnfinished(f"sbatch refused the prepare job (exit {e.returncode}); its script is "
                                  f"{logging_dir / 'launch_script.slurm'}") from None
        _wait_for_slurm(executor, logging_dir)
    else:
        executor = _run_on_ray(pipeline, o, logging_dir, progress)
    missing = executor.get_incomplete_ranks()
    if missing:
        raise TasksUnfinished(f"{len(missing)} of {o.tasks} prepare tasks did not finish (first: task {missing[0]}; "
                              f"its log: {logging_dir / 'logs'}); run the same prepare-data again to run only those")


def _slurm_executor(pipeline: list, o: ExecutorOptions, logging_dir: Path, name: str):
    from datatrove.executor import SlurmPipelineExecutor

    # The tasks run this interpreter's environment: its bin directory (datatrove's
    # launch_pickled_pipeline) first on PATH; sbatch passes the rest of the environment on.
    env_command = f"export PATH={Path(sys.executable).parent}:$PATH; cd {Path.cwd()}"
    return SlurmPipelineExecutor(
        pipeline, tasks=o.tasks, workers=o.workers or -1, time=o.slurm_time, partition=o.slurm_partition,
        cpus_per_task=o.cpus_per_task, mem_per_cpu_gb=o.mem_per_cpu_gb, job_name=name,
        qos="", env_command=env_command, logging_dir=str(logging_dir),
        slurm_logs_folder=str(logging_dir / "slurm_logs"), mail_type="NONE")


def _wait_for_slurm(executor, logging_dir: Path) -> None:
    """Until every task is complete, or the job has left the queue with some not."""
    if executor.job_id in (None, -1):
        return
    while executor.get_incomplete_ranks():
        done = subprocess.run(["squeue", "-h", "-j", str(executor.job_id), "-o", "%T"], capture_output=True,
                              text=True)
        if not _ALIVE.intersection(done.stdout.split()) and executor.get_incomplete_ranks():
            missing = executor.get_incomplete_ranks()
            raise TasksUnfinished(f"SLURM job {executor.job_id} ended with {len(missing)} prepare task(s) "
                                  f"unfinished (first: task {missing[0]}; logs: {logging_dir / 'slurm_logs'}); run "
                                  "the same prepare-data again to run only those")
        time.sleep(_POLL_SECONDS)


def _run_on_ray(pipeline: list, o: ExecutorOptions, logging_dir: Path, progress: bool):
    import logging

    import ray
    from datatrove.executor import RayPipelineExecutor

    started_here = not ray.is_initialized()
    if started_here:
        # "local": a new Ray here, never one an earlier `ray start` left recorded in /tmp/ray
        ray.init(address=o.ray_address or "local", include_dashboard=False, log_to_driver=progress,
                 logging_level=logging.INFO if progress else logging.ERROR,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        executor = RayPipelineExecutor(pipeline, tasks=o.tasks, workers=o.workers or -1, logging_dir=str(logging_dir),
                                       cpus_per_task=o.cpus_per_task, mem_per_cpu_gb=o.mem_per_cpu_gb)
        executor.run()
    finally:
        if started_here:
            ray.shutdown()
    return executor
