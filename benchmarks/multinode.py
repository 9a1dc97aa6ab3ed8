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
   they issue (a TorchDispatchMode over the whole process, installed by the ranks' entry module
   trinity_harness/train_instrumented.py, the launchers' TRAIN_MODULE): the payload each rank sends
   to the other (all-gather: its shard x (n-1); reduce-scatter and all-reduce: (n-1)/n and
   2(n-1)/n of the tensor; all-to-all: the rows for other ranks), by kind, next to the planner's
   byte model (`theory`: trinity_train/plan/formula.py's `traffic_per_rank`). A calibration on the bed measures what gloo puts on the
   wire per credited byte of each kind (a 16 MiB tensor; FSDP's reduce-scatter takes the
   all-to-all's, which it is on gloo: parallel/gloo/reduce_scatter.py); payload x that factor
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
   each rank's training thread timed by the place that waits (trinity_harness/instruments.py: an FSDP unit's
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
   1 host and at 1 Gbit/s with every setting of `ablation_settings()` in turn (none of the overlaps, then the
   reduce-scatters overlapped, the all-gathers prefetched, and the reshard policy's memory rule:
   the default), per round; ratios to the same round's 1-host job
   with the same settings. The changes that send fewer bytes have no setting to turn off; what
   they bought is measured across revisions in benchmarks/README.md §12.

The 2-rank job has one rank per host, so its expert groups span the hosts, which the launchers
refuse unless asked: it runs with `--parallel.allow_ep_tp_across_nodes=true` (`PAIR`).

Needs root and iproute2 (network namespaces). The bed is "tb" hosts at 10.218.0.x; traffic goes
only to loopback and the bed's own addresses. The bed is taken down on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from trinity_harness.cluster_bed import bed_unavailable, surviving_train_records
from trinity_harness.instruments import COUNTER_ENV, ITERATION_WALL, WAITS_ENV, rank_iterations
from trinity_harness.jobs import (CALIBRATION_MB, COMMON, CONDITIONS, CPU_KINDS, PAIR, WARMUP_ITERS, Bench, Layout,
                                  RecoveryJob, bench_on_bed, calibrate, exposed, gloo_overlap_env, instrumented_env,
                                  kind_of, loadavg,
                                  median_step_s, tail, train_records)
from trinity_train.config import default_config_path, load_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.formula import local_tokens, model_params, traffic_per_rank
from trinity_train.records import EventName

RECOVERY_TIMEOUT_S = 900  # the recovery job
COLLECTIVE_TIMEOUT_S = 8
# Section 6 (--bf16-wire): the 2-rank job with both opt-in low-precision wires (DESIGN §4).
BF16_WIRE = ("--parallel.ep_wire_dtype=bf16", "--parallel.reduce_wire_dtype=bf16")
PAIR_BF16_WIRE = Layout(1, (*PAIR.args, *BF16_WIRE), "1 host x 2 ranks, bf16 wire", "2 hosts, bf16 wire")
# Section 4 (--hsdp): 4 ranks, HSDP 2 x 2, EP inside a replica; 2 per host keep both inside a host.
HSDP = Layout(2, ("--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.micro_batch_size=2"),
              "1 host x 4 ranks, HSDP", "2 hosts x 2 ranks, HSDP")

# The ablation's switches: the CPU overlaps through the harness's entry module (no config key
# turns them off: trinity_harness/train_instrumented.py, GLOO_OVERLAP_ENV), the reshard policy's
# memory rule through its key. {variant: (train args, environment)}, in the order the ablation turns
# them on (parallel/gloo), ending at the default; `where_jobs` takes "no overlap" from here too.
def ablation_settings() -> dict[str, tuple[tuple[str, ...], dict]]:
    last_block_kept_only = ("--parallel.keep_gathered_gib=0",)
    return {
        "no overlap": (last_block_kept_only, gloo_overlap_env("none")),
        "+ reduce-scatter overlapped": (last_block_kept_only, gloo_overlap_env("reduce_scatter")),
        "+ all-gather prefetched": (last_block_kept_only, {}),
        "+ blocks kept gathered within 1 GiB (default)": ((), {}),
    }


def recovery(bench: Bench, steps: int) -> dict:
    """One bed job with three faults in turn (node loss, partition, frozen rank): seconds from each
    to the restarted attempt's run_start and its first step."""
    run_dir, head, env = bench.next_job("recovery")
    env = {**env, "MAX_RESTARTS": "5"}
    args = (f"--train.steps={steps}", "--checkpoint.every=1", f"--parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S}")
    procs, logs = bench.start_bed_job(run_dir, head, env, args)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    job = RecoveryJob(run_dir, deadline)
    result: dict = {"load_start": loadavg(), "steps": steps}
    try:
        job.wait(lambda: job.checkpointed(1), "the first checkpoint")

        fault = time.time()
        bench.bed.kill_host(1)
        more, more_logs = bench.start_bed_job(run_dir, head, env, args, index=1)
        procs.update(more)
        logs += more_logs
        result["node loss"] = job.recovered(fault, "node loss")
        job.wait(lambda: job.trained_after(fault, 2), "two steps after the node loss")

        fault = time.time()
        bench.bed.partition(1)
        time.sleep(2 * COLLECTIVE_TIMEOUT_S)
        bench.bed.heal(1)
        result["partition"] = job.recovered(fault, "partition")
        job.wait(lambda: job.trained_after(fault, 2), "two steps after the partition")

        fault = time.time()
        workers = bench.bed.worker_pids(1)
        if not workers:
            raise RuntimeError("no worker process on host 1 to freeze")
        os.kill(workers[0], signal.SIGSTOP)  # torchrun SIGKILLs it after its SIGTERM grace
        result["frozen rank"] = job.recovered(fault, "frozen rank")

        for p in procs.values():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = {i: p.returncode for i, p in procs.items()}
        result["exit codes"] = codes
        records = surviving_train_records(train_records(run_dir))
        result["finished_steps"] = len(records)
        result["step_s"] = median_step_s(records)
        result["restarts"] = sum(1 for e in job.events() if e.get("event") == EventName.RUN_START) - 1
    except Exception as e:
        raise RuntimeError(f"recovery: {e}\n{tail(logs)}") from e
    result["load_end"] = loadavg()
    return result


def theory(overrides: tuple[str, ...], world: int) -> dict:
    """Bytes each rank sends per step by category, by the planner's byte model
    (trinity_train/plan/formula.py's `traffic_per_rank`, gloo ranks: `gpu=False`), and the model's
    parameter counts."""
    cfg = load_config(default_config_path(), list(overrides))
    dims = ParallelDims.from_config(cfg, world)
    sizes: dict = {}
    for flow in traffic_per_rank(cfg, dims, gpu=False):
        sizes[flow.category] = sizes.get(flow.category, 0.0) + flow.sent
    params = [p for layer in model_params(cfg.model, dims.tp, dims.ep) for p in layer]
    expert = sum(p.global_numel for p in params if p.unit == "experts")
    total = sum(p.global_numel for p in params)
    return {**sizes, "params": total, "sharded_params": total - expert, "expert_params": expert,
            "tokens_per_rank": local_tokens(cfg, dims)}


def count_job(bench: Bench, steps: int) -> dict:
    counter_dir = bench.work / "collectives"
    result = bench.throughput_job(PAIR.condition("count", "unshaped, counting"), (), steps,
                                  extra_env=instrumented_env(COUNTER_ENV, counter_dir))
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
    (trinity_harness/instruments.py) on 1 host (condition a), at 1 Gbit/s (c), at 200 Mbit/s (d), and at
    1 Gbit/s with no overlap (`ablation_settings()`): each row
    gets, per rank, the median seconds per iteration at each site over the iterations after the
    warm-up."""
    (a, a_link, a_shape), (c, c_link, c_shape), (d, d_link, d_shape) = CONDITIONS[0], CONDITIONS[2], CONDITIONS[3]
    rows, (no_overlap_args, no_overlap_env) = [], ablation_settings()["no overlap"]
    for name, shape, extra, env in ((PAIR.condition(a, a_link), a_shape, (), {}),
                                    (PAIR.condition(c, c_link), c_shape, (), {}),
                                    (PAIR.condition(d, d_link), d_shape, (), {}),
                                    (PAIR.condition(c, c_link + ", no overlap"), c_shape, no_overlap_args, no_overlap_env)):
        waits_dir = bench.work / f"waits-{len(rows)}"
        row = bench.throughput_job(name, shape, steps, extra_env={**env, **instrumented_env(WAITS_ENV, waits_dir)},
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
                             "1 Gbit/s without overlap")
    parser.add_argument("--bf16-wire", action="store_true",
                        help="also run the rounds with the opt-in bf16 wire (parallel.ep_wire_dtype and "
                             "parallel.reduce_wire_dtype = bf16)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_ITERS + 2 or args.count_steps <= WARMUP_ITERS + 2:
        parser.error(f"--steps and --count-steps must be above {WARMUP_ITERS + 2} (the first {WARMUP_ITERS} are warm-up)")

    reason = bed_unavailable()
    if reason is not None:
        print(f"benchmarks/multinode.py: {reason}", file=sys.stderr)
        return 2
    print(f"# load: {loadavg()}", flush=True)
    print(f"# train args: {' '.join(COMMON + PAIR.args)} (default model, configs/debug.toml; OMP_NUM_THREADS=1 "
          "per rank)")
    out: dict = {"load_start": loadavg(), "args": vars(args), "common": COMMON}
    try:
        with bench_on_bed() as bench:
            bench_body(bench, args, out)
    except KeyboardInterrupt as e:
        print(f"benchmarks/multinode.py: interrupted ({e or 'SIGINT'}); the bed and every job are taken down",
              file=sys.stderr)
        return 130
    out["load_end"] = loadavg()
    print(f"# load after: {out['load_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0



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
        rec = recovery(bench, args.recovery_steps)
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
    """What each overlap setting buys: every variant of `ablation_settings()` on 1 host x 2 ranks (a one host
    must not get slower) and at 1 Gbit/s, per round; ratios to the same round's 1-host job with
    the same settings."""
    rows = []
    for rnd in range(1, args.rounds + 1):
        for variant, (extra, env) in ablation_settings().items():
            (a, a_link, a_shape), (c, c_link, c_shape) = CONDITIONS[0], CONDITIONS[2]
            local = bench.throughput_job(PAIR.condition(a, a_link), a_shape, args.steps, extra_env=env, extra_args=extra)
            gbit = bench.throughput_job(PAIR.condition(c, c_link), c_shape, args.steps, extra_env=env, extra_args=extra)
            row = {"round": rnd, "variant": variant, "settings": [*extra, *(f"{k}={v}" for k, v in env.items())],
                   "one_host": local, "1gbit": gbit,
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
    for variant in ablation_settings():
        mine = [r for r in rows if r["variant"] == variant]
        cells = [", ".join(fmt(r) for r in mine) for fmt in (
            lambda r: format(r["one_host"]["tokens_per_s"], ",.0f"), lambda r: format(r["1gbit"]["tokens_per_s"], ",.0f"),
            lambda r: format(r["1gbit"]["step_s"], ".2f"), lambda r: exposed(r["1gbit"]), lambda r: format(r["ratio"], ".2f"))]
        print(f"| {variant} | {' | '.join(cells)} |")
    print(flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
