"""What a training rank of a benchmark job runs to measure itself, installed by
`train_instrumented` (the job's entry, `TRAIN_MODULE=trinity_harness.train_instrumented` in the
launchers) when the environment names an output folder:

- `COUNTER_ENV`: the collective counter (`install_collective_counter`): the bytes this rank sends
  in every collective, per iteration (`multinode.py`'s bytes per step);
- `WAITS_ENV`: the wait profiler (`install_wait_profiler`, `multinode.py --where`), below.

Where a rank's exposed communication sits: the seconds its training thread waits in collectives,
by the place that waits, per training iteration.

`trinity_train.health.collective_waits` times the waits (every collective of a step ends in
`Work.wait()` or `_functional_collectives.wait_tensor`) and this module names each by the stack
above it (`site`): an FSDP unit's all-gather (by the unit's name), the FSDP reduce-scatters,
the embedding's row all-gather and reduce-scatter (parallel/gloo/embedding_all_gather.py and
embedding_reduce_scatter.py: before this table had them, the reduce-scatter's waits counted as the
embedding's all-gather), the EP all-to-alls of the forward and of the backward, Muon's exchange,
the step's reductions (token count, loss totals, gradient norm; the token count's is waited in
the step itself). A wait includes the time the other rank took to arrive: what a
rank waits for is the network and the other rank's compute together, so the 1-host job's waits are
the baseline a link's are read against. Written to OUT_DIR/waits{RANK}.json after every iteration:
{iteration: {site: [waits, seconds]}}, and the iteration's wall time as "iteration wall".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trinity_train.health.collective_waits import CollectiveWaits

ITERATION_WALL = "iteration wall"
COUNTER_ENV = "TRINITY_BENCH_COLLECTIVES"  # `install_collective_counter`'s output folder
WAITS_ENV = "TRINITY_BENCH_WAITS"  # `install_wait_profiler`'s output folder


def site(frame) -> str:
    """The caller a wait is charged to, from the stack above `frame`."""
    if frame is not None and frame.f_code.co_filename.endswith("trinity_train/step.py"):
        return "reductions (tokens, loss, grad norm)"  # the token count's, started early, waited there
    in_backward = ep = False
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path.endswith("parallel/gloo/reduce_scatter.py"):  # innermost: also where FSDP calls it
            return "FSDP reduce-scatter"
        owner = frame.f_locals.get("self")
        if path.endswith("embedding_all_gather.py"):  # (the exchanges it calls are row_exchange.py's)
            return "FSDP all-gather, embedding rows"
        if type(owner).__name__ == "TouchedRowsReduceScatter":
            return "FSDP reduce-scatter, embedding rows"
        if type(owner).__name__ == "FSDPParamGroup":  # an unshard's wait, inside the module's hooks
            return f"FSDP all-gather, {owner._module_fqn or 'root'}"
        if "trinity_train" in path:
            if path.endswith("muon_exchange.py") or path.endswith("muon.py"):
                return "Muon exchange"
            if path.endswith("reductions.py"):
                return "reductions (tokens, loss, grad norm)"
            if path.endswith("rank_stats.py"):
                return "rank statistics"
            if path.endswith("expert_parallel.py") or path.endswith("moe.py"):
                ep = True
        if name == "_engine_run_backward":
            in_backward = True
        frame = frame.f_back
    if ep:
        return "EP all-to-all, backward" if in_backward else "EP all-to-all, forward"
    return "other"


class WaitSites:
    """While installed (a context manager), the installing thread's collective waits by `site`:
    `waits[site] = [count, seconds]`, growing (timed by `CollectiveWaits`, the wrapper that
    times the `ranks` records' exposed communication)."""

    def __init__(self):
        self.waits: dict[str, list] = {}
        self._timer = CollectiveWaits(on_wait=self._record)

    def _record(self, seconds: float, caller) -> None:
        tally = self.waits.setdefault(site(caller), [0, 0.0])
        tally[0] += 1
        tally[1] += seconds

    def __enter__(self) -> WaitSites:
        self._timer.install()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.uninstall()


def install_wait_profiler(out_dir: str) -> None:
    """For the rest of this training process: its waits by site, per iteration, in
    OUT_DIR/waits{RANK}.json (rewritten after every iteration)."""
    import trinity_train.train as trainer_module

    path = Path(out_dir) / f"waits{os.environ.get('RANK', '0')}.json"
    sites = WaitSites().__enter__()
    table: dict[str, dict] = {}
    original = trainer_module.Trainer.train_one_iteration

    def profiled_iteration(self):
        sites.waits.clear()
        start = time.perf_counter()
        try:
            return original(self)
        finally:
            sites.waits[ITERATION_WALL] = [1, time.perf_counter() - start]
            table[str(self.state.iteration)] = dict(sites.waits)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table))
            tmp.replace(path)

    trainer_module.Trainer.train_one_iteration = profiled_iteration


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


def rank_iterations(out_dir: Path, name: str, first: int, last: int) -> list[list[dict]]:
    """Per rank of the 2-rank job: the per-iteration tables its instrument wrote to
    OUT_DIR/{name}{rank}.json ({iteration: table}, and the counter's "setup": what came before the
    first iteration), iterations `first` to `last`."""
    per_rank = []
    for rank in (0, 1):
        data = json.loads((out_dir / f"{name}{rank}.json").read_text())
        per_rank.append([table for it, table in data.items() if it.isdigit() and first <= int(it) <= last])
    return per_rank
