"""`trinity-train calibrate`: measure what `plan` prices on the nodes of the coming job and write a
hardware profile (`plan/profile.py`) that `plan --hardware PROFILE` prices with.

Started as the job will be (`launch/local.sh N calibrate ...`, `launch/multinode.sh ... --
calibrate ...`, `launch/slurm.sbatch calibrate ...`, or torchrun with `-m trinity_train.cli
calibrate`), with the job's config and overrides: the config gives the shapes (matmuls, experts, a
training step) and the message sizes (the plan's flows at this world size); the launch gives the
nodes and ranks per node. One process without a launcher measures compute and memory only.

The time limit (`--time-limit`, default `DEFAULT_TIME_LIMIT_S`) bounds the whole run: compute
takes `COMPUTE_SHARE` of it, the links the rest; each measurement prints one line on rank 0 as it
ends, and rank 0 writes the profile at the end (a temporary file renamed into place: a profile is
complete or absent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trinity_train import exit_codes
from trinity_train.errors import ConfigError

DEFAULT_TIME_LIMIT_S = 120.0
COMPUTE_SHARE = 0.3  # of the time limit: matmuls, the grouped matmul, the training step
DEFAULT_OUT = "hardware-profile.json"


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    from trinity_train.files import user_path

    parser.add_argument("--config", type=user_path, help="the job's TOML config (default: configs/debug.toml)")
    parser.add_argument("--out", type=user_path, default=Path(DEFAULT_OUT),
                        help=f"where rank 0 writes the hardware profile (default {DEFAULT_OUT})")
    parser.add_argument("--time-limit", default=str(DEFAULT_TIME_LIMIT_S), metavar="S",
                        help=f"seconds the whole calibration may take (default {DEFAULT_TIME_LIMIT_S:g}); a link too "
                             "slow for a size within its share is reported as too slow, not as a number")


def time_limit_option(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 5 <= value <= 3600:
        raise ConfigError(f"--time-limit {text!r} must be a number of seconds from 5 to 3600 (default "
                          f"{DEFAULT_TIME_LIMIT_S:g})")
    return value


def run_calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from trinity_train.config import default_config_path
    from trinity_train.run_config import load_run_config

    limit = time_limit_option(args.time_limit)
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out '{out}' is a directory: give the profile's file name, e.g. {out / DEFAULT_OUT}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out '{out}': its directory {out.parent} does not exist")
    config = args.config or default_config_path()
    cfg = load_run_config(config, overrides)
    return Calibration(cfg, str(config), out, limit).run()


class Calibration:
    def __init__(self, cfg, config: str, out: Path, limit: float):
        self.cfg, self.config, self.out, self.limit = cfg, config, out, limit
        self.started = time.perf_counter()
        self.rank = int(os.environ.get("RANK", "0"))

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def run(self) -> int:
        import torch

        from trinity_train.config import grad_accum_for
        from trinity_train.parallel.process_group import destroy_distributed, init_distributed, leave_together

        # Joined as training joins (the layout checked, the ranks' configs compared, the job's mesh
        # built): the training step below runs on that mesh, the links on subgroups of the world.
        dims, device = init_distributed(self.cfg)
        world = dims.world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            nodes = self._nodes(world)
            self.say(f"calibrate: {world} rank(s) on {len(nodes)} node(s) ({', '.join(sorted(nodes))}); {device.type}, "
                     f"{backend if world > 1 else 'one process'}, torch {torch.__version__}; at most {self.limit:g} s")
            compute = self._compute(device, dims, grad_accum_for(self.cfg.train, dims.dp), nodes)
            curves = self._links(dims, device, nodes, world)
            if world > 1:
                leave_together()
        finally:
            if dims.is_distributed:
                destroy_distributed()
        if self.rank == 0:
            self._write(torch.__version__, backend, device, nodes, compute, curves)
        return exit_codes.DONE

    def _nodes(self, world: int) -> dict[str, list[int]]:
        import socket

        if world == 1:
            return {socket.gethostname(): [0]}
        from trinity_train.calibrate.links import node_map

        return node_map()

    def _compute(self, device, dims, grad_accum: int, nodes: dict[str, list[int]]) -> dict:
        import torch

        from trinity_train.calibrate.compute import (LARGE_SQUARE, gemm_shapes, grouped_rate, matmul_rates,
                                                     step_model, step_rate, usable_memory, weighted_rate)
        from trinity_train.calibrate.links import agreed_max

        cfg, budget = self.cfg, self.limit * COMPUTE_SHARE
        dtype = torch.bfloat16 if device.type == "cuda" and cfg.train.dtype == "bf16" else torch.float32
        tokens = cfg.train.micro_batch_size * cfg.data.seq_len // dims.cp
        shapes = gemm_shapes(cfg.model, tokens, cfg.model.loss_chunk_tokens)
        each = budget * 0.3 / (len(shapes) + 2)
        rates = matmul_rates(shapes, dtype, device, each)
        matmul = weighted_rate(rates)
        peak = matmul_rates([(LARGE_SQUARE,) * 3], dtype, device, each)[(LARGE_SQUARE,) * 3]
        self.say(f"  matmul, {str(dtype).removeprefix('torch.')}: {matmul / 1e9:,.1f} GFLOP/s at the config's "
                 f"{len(shapes)} shapes (" + ", ".join(f"{a}x{b}x{c} {r / 1e9:,.0f}" for (a, b, c), r in rates.items())
                 + f"); {peak / 1e9:,.1f} at {LARGE_SQUARE}^3")
        grouped = grouped_rate(cfg.model, tokens, dims.ep, dtype, device, each)
        if grouped is not None:
            self.say(f"  grouped matmul (routed experts, {max(cfg.model.num_experts // dims.ep, 1)} a rank): "
                     f"{grouped / 1e9:,.1f} GFLOP/s")
        measured = step_model(cfg)  # the job's layout and batch: its mesh serves
        step = step_rate(measured, dims, device, budget - (time.perf_counter() - self.started))
        rate = step.flops_per_s
        how = "the loop thread's CPU time" if device.type == "cpu" else "wall"
        self.say(f"  training step on the job's ranks and layout ({step.layers} of {cfg.model.num_layers} blocks, "
                 f"{cfg.train.micro_batch_size} x {grad_accum} micro-batches of {cfg.data.seq_len} tokens a rank): "
                 f"compute {step.compute_s * 1e3:,.1f} ms ({how}) of "
                 f"{step.wall_s * 1e3:,.1f} ms -> {rate / 1e9:,.1f} GFLOP/s (medians of {step.steps})")
        ranks_here = next(len(r) for r in nodes.values() if self.rank in r)
        memory = usable_memory(device, ranks_here)
        # The job runs at its slowest rank and fits in its fullest: the least of each over the ranks.
        if dims.is_distributed:
            lows = agreed_max(-matmul, -peak, -(grouped or 0.0), -rate, -float(memory))
            matmul, peak, grouped_low, step_flops, memory = (-v for v in lows)
            grouped = grouped_low if grouped is not None else None
        else:
            step_flops = rate
        self.say(f"  usable memory per rank: {memory / 2**30:,.2f} GiB ({'free GPU memory' if device.type == 'cuda' else 'available memory of the node over its ranks'})")
        return {"matmul": matmul, "peak": peak, "grouped": grouped, "step": step_flops, "memory": int(memory),
                "dtype": str(dtype).removeprefix("torch.")}

    def _links(self, dims, device, nodes: dict[str, list[int]], world: int) -> dict:
        if world == 1:
            self.say("  links: one process, nothing to measure (launch with the job's launcher and nodes)")
            return {}
        from trinity_train.calibrate.links import LinkCalibration, Measurement, link_groups
        from trinity_train.plan.formula import traffic_per_rank
        from trinity_train.plan.profile import LINK_NAMES

        flows = traffic_per_rank(self.cfg, dims, gpu=device.type == "cuda")
        largest = max((f.sent / f.calls for f in flows if f.calls), default=0.0)

        def report(m: Measurement) -> None:
            what = f"  {LINK_NAMES[m.link]:<14}{m.kind.replace('_', '-'):<15}{m.size / 2**20:>10.3f} MiB"
            if m.seconds is None:
                self.say(f"{what}   too slow: its first call took longer than its {m.allowed:.3g} s (larger sizes "
                         "not tried)")
            else:
                self.say(f"{what}{m.seconds * 1e3:>11.3f} ms a call{m.size / m.seconds / 1e6:>11,.1f} MB/s a rank "
                         f"({m.repeats} calls)")

        groups = link_groups(nodes)
        left = self.limit - (time.perf_counter() - self.started)
        return LinkCalibration(groups, device, largest, max(left - 1.0, 0.0), report).run()

    def _write(self, torch_version: str, backend: str, device, nodes, compute: dict, curves: dict) -> None:
        import torch

        from trinity_train.plan.profile import LINK_NAMES, HardwareProfile, profile_record

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        elapsed = time.perf_counter() - self.started
        profile = HardwareProfile(str(self.out), torch_version, backend, name, compute["dtype"], nodes,
                                  compute["memory"], compute["matmul"], compute["peak"], compute["grouped"],
                                  compute["step"], curves, self.config, round(elapsed, 2), self.limit)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(profile_record(profile), indent=1) + "\n")
        tmp.replace(self.out)
        for link, name in LINK_NAMES.items():
            per_rank = profile.link_bandwidth(link)
            if per_rank:  # across nodes, a node's ranks send at once through its NIC
                node = (f" ({per_rank * profile.ranks_per_node * 8 / 1e9:.3g} Gbit/s a node, its "
                        f"{profile.ranks_per_node} ranks at once)" if link == "across" else "")
                self.say(f"  {name}: {per_rank / 1e6:,.1f} MB/s a rank one way at the largest send{node}")
        self.say(f"calibrate: wrote {self.out} in {elapsed:.1f} s (limit {self.limit:g} s); price a job on it with "
                 f"`trinity-train plan --hardware {self.out}`")
        if elapsed > self.limit:
            print(f"warning: calibrate took {elapsed:.1f} s, over its {self.limit:g} s", file=sys.stderr)
