"""A hardware profile: what `trinity-train calibrate` measured on the nodes of a coming job, and how
`trinity-train plan --hardware PROFILE` prices a step on it. This module owns the profile's JSON
format (`FORMAT`, `VERSION`); calibrate writes it with `profile_record`, plan reads it with
`load_profile`.

What a profile holds, per rank and as the job will run (every rank measuring at once, so ranks
that share a node's CPU, memory bus or NIC share it here too):

- the rank-to-node map (node names), torch's version, the backend (gloo or NCCL), the device;
- the usable memory of a rank (a GPU's free memory; a CPU node's available memory over its ranks);
- compute: the matmul rate at the config's shapes in its dtype (`matmul_flops`, a FLOP-weighted
  mean), the grouped matmul of the routed experts, and the rate a training step of the config's
  model (cut to a few blocks) reaches on the job's own ranks and layout, its compute without the
  time blocked in collectives (`step_flops`: forward, backward and the optimizer). The plan's compute time is the model's FLOPs over `step_flops`, and the MFU it
  reports is `step_flops / matmul_flops`: measured, not assumed;
- per link class (inside a node, across nodes) and collective kind (all-gather, reduce-scatter,
  all-reduce, all-to-all, and a one-way send: the link's headline rate), the seconds of one call
  at the sizes measured, sizes in bytes a rank sends by `plan/collectives.py`'s rule (so a flow's
  bytes divide by it directly). A size whose
  first call outlasted its share of the time is stored as too slow, and larger sizes were not
  tried: a plan that needs that link at that size says so instead of pricing it.

A call of a size between two measured sizes takes the time interpolated between them (the
latency-plus-bandwidth line through the two); a smaller one the smallest size's time (latency-
bound), a larger one the largest size's bandwidth.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from trinity_train.errors import ConfigError
from trinity_train.plan.collectives import (FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE,
                                            FSDP_REDUCE_SCATTER)
from trinity_train.plan.hardware import Hardware

FORMAT = "trinity-train hardware profile"
VERSION = 1
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # the collectives a plan prices
# One direction, point to point (half a group's ranks send, the other half receive): the link's own
# rate, the headline of each class, comparable with a single stream's (and a plan's sends).
SEND = "send"
LINKS = ("inside", "across")  # a group inside one node; a group spanning nodes
LINK_NAMES = {"inside": "inside a node", "across": "across nodes"}


@dataclass(frozen=True)
class Curve:
    """One collective kind on one link class: (bytes a rank sends in one call, seconds of the
    call) at each measured size, smallest first; `too_slow`: the size whose first call took
    longer than the time it was given (None when every size tried finished)."""

    points: tuple[tuple[float, float], ...]
    too_slow: tuple[float, float] | None = None  # (bytes, seconds allowed)

    def seconds(self, size: float) -> float | None:
        """One call of `size` bytes; None where the link was too slow at or below that size."""
        if self.too_slow is not None and size >= self.too_slow[0] or not self.points:
            return None
        sizes = [s for s, _ in self.points]
        if size <= sizes[0]:
            return self.points[0][1]
        if size >= sizes[-1]:
            s, t = self.points[-1]
            return t * size / s
        i = next(i for i, s in enumerate(sizes) if s >= size)
        (s0, t0), (s1, t1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (size - s0) / (s1 - s0)

    @property
    def bandwidth(self) -> float:
        """Bytes per second at the largest size measured (0 without one)."""
        if not self.points:
            return 0.0
        s, t = self.points[-1]
        return s / t


@dataclass(frozen=True)
class HardwareProfile:
    path: str
    torch: str
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or the GPU's name
    dtype: str  # the compute dtype the rates were measured in
    nodes: dict[str, list[int]]  # node name -> its ranks
    memory_bytes: int  # usable memory per rank
    matmul_flops: float  # FLOP/s at the config's matmul shapes (FLOP-weighted)
    peak_flops: float  # FLOP/s of a large square matmul
    grouped_flops: float | None  # FLOP/s of the routed experts' grouped matmul (None: dense model)
    step_flops: float  # FLOP/s a training step of the config's model reaches on a rank of the job's layout
    curves: dict[tuple[str, str], Curve] = field(default_factory=dict)  # (link, kind) -> curve
    config: str = ""
    seconds: float = 0.0  # how long the calibration took
    time_limit_s: float = 0.0

    @property
    def name(self) -> str:
        return f"profile {Path(self.path).name}"

    @property
    def ranks_per_node(self) -> int:
        return max(len(r) for r in self.nodes.values())

    @property
    def mfu(self) -> float:
        """The training step's measured rate over the matmul rate at the config's shapes."""
        return self.step_flops / self.matmul_flops

    @property
    def overlaps_communication(self) -> bool:
        """NCCL runs collectives on streams of their own beside the compute; a CPU job's gloo
        collectives mostly do not overlap it (the bed's exposed communication equals its wire
        time: docs/results/2026-12-04-multinode.md), so its step is priced without overlap."""
        return self.backend != "gloo"

    def link_bandwidth(self, link: str) -> float:
        """Bytes per second one rank sends over `link` one way, at the largest send measured (the
        headline figure; 0 where the class was not measured)."""
        curve = self.curves.get((link, SEND))
        return curve.bandwidth if curve else 0.0

    def call_seconds(self, kind: str, link: str, size: float) -> float:
        """One call of `kind` over `link` sending `size` bytes from this rank, or a one-line
        error where the profile cannot price it."""
        curve = self.curves.get((link, kind))
        if curve is None:
            why = ("one node: calibrate on at least two nodes" if link == "across" else
                   "one rank per node: calibrate with at least two ranks per node")
            raise ConfigError(f"{self.path}: the profile has no {kind.replace('_', '-')} {LINK_NAMES[link]} (it was "
                              f"measured with {why}, as the job will run)")
        seconds = curve.seconds(size)
        if seconds is None:
            size_mb, allowed = curve.too_slow
            raise ConfigError(f"{self.path}: the link {LINK_NAMES[link]} was too slow to measure a "
                              f"{kind.replace('_', '-')} of {size_mb / 1e6:.3g} MB within {allowed:.3g} s, and this plan "
                              f"sends {size / 1e6:.3g} MB a call: calibrate again with a longer --time-limit")
        return seconds


def wire_kind(category: str, kind: str, backend: str) -> str:
    """The collective a flow or traced call runs as on `backend`: a CPU job's FSDP reduce-scatter
    and its embedding's rows both ways are all-to-alls (parallel/gloo); a broadcast is priced as an
    all-gather."""
    if backend == "gloo" and category in (FSDP_REDUCE_SCATTER, FSDP_EMBEDDING_ROWS_GATHER,
                                          FSDP_EMBEDDING_ROWS_REDUCE):
        return "all_to_all"
    return {"broadcast": "all_gather"}.get(kind, kind)


@dataclass(frozen=True)
class ProfiledHardware(Hardware):
    """A profile as the plan's `Hardware`: memory and compute from the measurements, and each
    collective priced by its kind, link class and size instead of one datasheet rate per link."""

    profile: HardwareProfile | None = None

    @property
    def overlaps_communication(self) -> bool:
        return self.profile.overlaps_communication

    def flow_seconds(self, category: str, kind: str, inside: bool, sent: float, calls: int) -> float:
        if sent <= 0 or calls <= 0:
            return 0.0
        per_call = self.profile.call_seconds(wire_kind(category, kind, self.profile.backend),
                                             "inside" if inside else "across", sent / calls)
        return per_call * calls


def as_hardware(profile: HardwareProfile) -> ProfiledHardware:
    """The profile as the plan prices on it: peak = the matmul rate at the config's shapes (the
    MFU is then the step's measured share of it), links at the largest all-gather's bandwidth
    (display only: `flow_seconds` prices each call by its curve)."""
    return ProfiledHardware(profile.name, profile.memory_bytes, profile.matmul_flops / 1e12,
                            profile.link_bandwidth("inside") / 1e9, profile.link_bandwidth("across") * 8 / 1e9,
                            profile=profile)


# ---------------------------------------------------------------------------- the JSON record


def profile_record(profile: HardwareProfile) -> dict:
    """The profile as JSON-able data (what calibrate writes)."""
    links = {}
    for (link, kind), curve in sorted(profile.curves.items()):
        links.setdefault(link, {})[kind] = {
            "points": [{"bytes": s, "seconds": t} for s, t in curve.points],
            "too_slow": None if curve.too_slow is None else {"bytes": curve.too_slow[0],
                                                             "seconds_allowed": curve.too_slow[1]}}
    return {"format": FORMAT, "version": VERSION, "torch": profile.torch, "backend": profile.backend,
            "device": profile.device, "dtype": profile.dtype, "nodes": profile.nodes,
            "memory_bytes": profile.memory_bytes,
            "compute": {"matmul_flops": profile.matmul_flops, "peak_flops": profile.peak_flops,
                        "grouped_flops": profile.grouped_flops, "step_flops": profile.step_flops},
            "links": links, "config": profile.config, "seconds": profile.seconds,
            "time_limit_s": profile.time_limit_s}


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile file, or a one-line error naming what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--hardware '{path}': no such file (write one with `trinity-train calibrate --out "
                          f"{path}` on the job's nodes)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--hardware '{path}' is not a readable JSON hardware profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"--hardware '{path}' is not a hardware profile (no \"format\": \"{FORMAT}\"); write "
                          "one with `trinity-train calibrate`")
    if data.get("version") != VERSION:
        raise ConfigError(f"--hardware '{path}' is a profile of version {data.get('version')!r}; this "
                          f"trinity-train reads version {VERSION}: calibrate again")
    try:
        curves = {}
        for link, kinds in data["links"].items():
            for kind, c in kinds.items():
                if link not in LINKS or kind not in (*KINDS, SEND):
                    raise ValueError(f"unknown link class or collective {link}/{kind}")
                points = tuple(sorted((float(p["bytes"]), float(p["seconds"])) for p in c["points"]))
                if any(not (s > 0 and t > 0 and math.isfinite(s) and math.isfinite(t)) for s, t in points):
                    raise ValueError(f"{link}/{kind}: sizes and seconds must be finite numbers > 0")
                slow = c.get("too_slow")
                if not points and slow is None:
                    raise ValueError(f"{link}/{kind}: neither a measured point nor a too-slow size")
                curves[(link, kind)] = Curve(points, None if slow is None else
                                             (float(slow["bytes"]), float(slow["seconds_allowed"])))
        compute = data["compute"]
        profile = HardwareProfile(
            str(path), str(data["torch"]), str(data["backend"]), str(data["device"]), str(data["dtype"]),
            {str(k): [int(r) for r in v] for k, v in data["nodes"].items()}, int(data["memory_bytes"]),
            float(compute["matmul_flops"]), float(compute["peak_flops"]),
            None if compute["grouped_flops"] is None else float(compute["grouped_flops"]),
            float(compute["step_flops"]), curves, str(data.get("config", "")), float(data.get("seconds", 0.0)),
            float(data.get("time_limit_s", 0.0)))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ConfigError(f"--hardware '{path}': a damaged hardware profile ({type(e).__name__}: {e}); "
                          "calibrate again") from None
    rates = (profile.matmul_flops, profile.step_flops, profile.peak_flops, profile.memory_bytes,
             1.0 if profile.grouped_flops is None else profile.grouped_flops)
    if not (all(0 < r < math.inf for r in rates) and profile.nodes):
        raise ConfigError(f"--hardware '{path}': a damaged hardware profile (rates, memory and nodes must be "
                          "finite and positive); calibrate again")
    return profile


def check_profile(profile: HardwareProfile, *, torch_version: str, cpu_plan: bool,
                  node_names: list[str] | None = None) -> None:
    """One line when the profile describes other hardware or software than the plan's job: another
    torch, the other backend (gloo profiles price CPU plans, NCCL ones GPU plans), or nodes the job
    will not run on (`node_names`, where the job's nodes are known)."""
    if profile.torch != torch_version:
        raise ConfigError(f"--hardware '{profile.path}' was measured with torch {profile.torch}, this is torch "
                          f"{torch_version}: kernels and collectives change between versions; calibrate again")
    wanted = "gloo" if cpu_plan else "nccl"
    if profile.backend != wanted:
        fix = "drop --cpu" if cpu_plan else "add --cpu to plan a CPU job"
        raise ConfigError(f"--hardware '{profile.path}' was measured with {profile.backend}, but this plan is of "
                          f"a {'CPU job (gloo)' if cpu_plan else 'GPU job (NCCL)'}: {fix}, or calibrate on the "
                          "job's devices")
    if node_names:
        missing = [n for n in node_names if n not in profile.nodes]
        if missing:
            raise ConfigError(f"--hardware '{profile.path}' was measured on {', '.join(sorted(profile.nodes))}, "
                              f"not on the job's {', '.join(missing)}: calibrate on the job's nodes")
