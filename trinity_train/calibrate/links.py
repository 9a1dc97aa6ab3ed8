"""The links of a job's nodes, measured by the collectives the plan prices.

Two link classes: inside a node (the ranks of one node, one group per node) and across nodes (the
i-th rank of every node, one group per i). Each class is measured with all its groups at once, as a
job's collectives run (a node's ranks share its NIC across nodes). For each collective kind the
plan prices (all-gather, reduce-scatter, all-reduce, all-to-all), and a one-way send (the link's
own rate, up to a bulk `SEND_UP_TO`), and each size, the seconds of one
call, where the size is the bytes a rank sends by `plan/collectives.py`'s rule. Each call is timed
alone, after a barrier, as a step's collectives start between its compute, and a size keeps the
fastest of up to `MAX_REPEATS` calls: what the link gives, as a matmul's rate is its fastest call.
Calls that send both ways at once vary from call to call on a TCP link (on the CPU bed's shaped
link, two opposite streams lost 25-41 % one way in 4 of 16 tries: benchmarks/bed_link.py,
docs/results/2026-12-03-multinode.md), while the bed's training job gets the full rate over a step
(docs/results/2026-12-07-calibrate.md): the median call priced its collectives well below it.

Every rank takes every decision from values all ranks agree on (an all-reduced maximum): how long
a call took, how much time is left. A size's first call is its warm-up and its probe: one that
takes longer than the time the size is given marks the link too slow at that size, and larger
sizes of that kind and class are not tried.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trinity_train.plan.profile import KINDS, LINK_NAMES, SEND, Curve

MAX_REPEATS = 10  # timed calls of one size, at most
MIN_SIZE = 16 * 2 ** 10  # the ladder's smallest message: 16 KiB a rank sends
LADDER_STEP = 4  # each size 4x the last
SEND_UP_TO = 64 * 2 ** 20  # a link's one-way rate is measured up to at least this (a bulk transfer)


def node_map() -> dict[str, list[int]]:
    """Node name -> the ranks on it, from every rank's host name."""
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    nodes: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return nodes


def link_groups(nodes: dict[str, list[int]]) -> dict[str, dist.ProcessGroup | None]:
    """This rank's group of each link class (None where the class has no group of 2 ranks for it):
    torch's `new_subgroups_by_enumeration`, which every rank calls with every group."""
    ranks = list(nodes.values())
    classes = {"inside": [r for r in ranks if len(r) > 1],
               "across": [g for g in ([r[i] for r in ranks if len(r) > i] for i in range(max(map(len, ranks))))
                          if len(g) > 1]}
    groups = {}
    for link, members in classes.items():
        groups[link] = dist.new_subgroups_by_enumeration(members)[0] if members else None
    return groups


def sizes_up_to(largest: float) -> list[int]:
    """The message sizes measured: `MIN_SIZE`, 4x each time, up to the first at or above `largest`."""
    sizes = [MIN_SIZE]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * LADDER_STEP)
    return sizes


def collective(kind: str, group: dist.ProcessGroup, sent: int, device: torch.device) -> Callable[[], None]:
    """One call of `kind` on `group` in which this rank sends `sent` bytes (fp32 elements)."""
    n = group.size()
    element = 4

    def elements(count: float) -> int:
        return max(int(count) // element, 1)

    if kind == "all_gather":  # sends its shard to n-1 ranks
        shard = torch.ones(elements(sent / (n - 1)), device=device)
        out = torch.empty(shard.numel() * n, device=device)
        return lambda: dist.all_gather_single(out, shard, group=group)
    if kind == "reduce_scatter":  # sends (n-1)/n of its input
        full = torch.ones(elements(sent * n / (n - 1)) // n * n or n, device=device)
        out = torch.empty(full.numel() // n, device=device)
        return lambda: dist.reduce_scatter_single(out, full, group=group)
    if kind == "all_reduce":  # a ring sends 2(n-1)/n of the tensor
        tensor = torch.ones(elements(sent * n / (2 * (n - 1))), device=device)
        return lambda: dist.all_reduce(tensor, group=group)
    if kind == "all_to_all":  # keeps 1/n, sends the rest
        full = torch.ones(elements(sent * n / (n - 1)) // n * n or n, device=device)
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if kind == SEND:  # the group's first half sends to its second half, one way (an odd last rank idles)
        ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)
        half = n // 2
        buffer = torch.ones(elements(sent), device=device)
        if me < half:
            return lambda: dist.send(buffer, dst=ranks[me + half], group=group)
        if me < 2 * half:
            return lambda: dist.recv(buffer, src=ranks[me - half], group=group)
        return lambda: None
    raise ValueError(f"unknown collective {kind!r}")


def agreed_max(*values: float) -> list[float]:
    """The largest of each value over all ranks (every rank gets the same numbers)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


@dataclass
class Measurement:
    link: str
    kind: str
    size: float  # bytes a rank sends per call
    seconds: float | None  # per call; None: too slow
    allowed: float  # the seconds this size was given
    repeats: int


class LinkCalibration:
    """Measures every (link class, kind, size) within `seconds`, all ranks together, every rank
    walking the same measurements (a rank without a group of a class takes part in the agreement)."""

    def __init__(self, groups: dict[str, dist.ProcessGroup | None], device: torch.device, largest: float,
                 seconds: float, report: Callable[[Measurement], None]):
        self.groups, self.device, self.report = groups, device, report
        self.sizes = {kind: sizes_up_to(largest) for kind in KINDS}
        self.sizes[SEND] = sizes_up_to(max(largest, SEND_UP_TO))
        links = [link for link in LINK_NAMES if self._someone_has(link)]
        self.todo = [(link, kind) for link in links for kind in (*KINDS, SEND)]
        self.seconds = -agreed_max(-seconds)[0]  # the least any rank has left: one budget for all

    def _someone_has(self, link: str) -> bool:
        return agreed_max(1.0 if self.groups.get(link) is not None else 0.0)[0] > 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, op: Callable[[], None] | None, calls: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls if op is not None else 0):
            op()
        self._sync()
        return time.perf_counter() - start

    def run(self) -> dict[tuple[str, str], Curve]:
        start = time.perf_counter()
        left = sum(len(self.sizes[kind]) for _, kind in self.todo)  # measurements still to come
        curves: dict[tuple[str, str], Curve] = {}
        for link, kind in self.todo:
            group = self.groups.get(link)
            points: list[tuple[float, float]] = []
            too_slow = None
            sizes = self.sizes[kind]
            for i, size in enumerate(sizes):
                op = collective(kind, group, size, self.device) if group is not None else None
                first, elapsed = agreed_max(self._timed(op, 1), time.perf_counter() - start)
                allowed = max(self.seconds - elapsed, 0.0) / left
                if first > allowed:
                    too_slow = (float(size), allowed)
                    self.report(Measurement(link, kind, size, None, allowed, 1))
                    left -= len(sizes) - i
                    break
                repeats = int(max(1, min(MAX_REPEATS, (allowed - first) // max(first, 1e-6))))
                # Each call timed alone after a barrier (a step's collectives start between its
                # compute), the slowest rank's time; the fastest of those calls (module doc).
                per_call = min(agreed_max(*(self._timed(op, 1) for _ in range(repeats))))
                points.append((float(size), per_call))
                self.report(Measurement(link, kind, size, per_call, allowed, repeats))
                left -= 1
            curves[(link, kind)] = Curve(tuple(points), too_slow)
        return curves
