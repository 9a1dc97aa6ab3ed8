"""`trinity-train plan`'s trace against what this machine measures (issue 29, "Checked against
what can be measured here"): memory, traffic and step time.

    python benchmarks/plan_vs_measured.py [--models default,100m] [--skip-memory] [--skip-traffic]
                                          [--skip-time] [--rounds 2] [--steps 8] [--experts]

1. Memory: rank 0's traced peak (`trace_rank(..., gpu=False)`) and the closed form's
   (`formula.memory_per_rank`) against a real step of the same
   config (trinity_harness/plan_runs.py: iteration 2 of a real Trainer on fresh gloo ranks, one OpenMP
   thread each), for the default model and a ~100M-parameter one (`HUNDRED_M`), one process,
   FSDP 2, FSDP 2 x EP 2 and TP 2 x FSDP 2 x EP 2 (4 ranks: ep must divide dp_shard), each with
   and without activation checkpointing, 4 x 256 tokens a step (micro-batch 2). The real peak is
   measured twice: by the planner's tracker on the real tensors (the same accounting: does the
   trace reproduce the real tensors' lifetimes?) and by the OS (peak RSS over the step above the
   RSS before it, + the parameters, gradients and optimizer state alive before it; glibc set to
   unmap freed allocations of 64 KiB or more, so RSS follows the live tensors).
2. Traffic: bytes per collective category of benchmarks/multinode.py's job (`COMMON`), traced
   against the job's real ranks on loopback (`CollectiveLog` over iteration 2). The embedding's
   row categories depend on the tokens: the trace counts the whole table, so their ratio is
   above 1 (an upper bound, not an error).
3. Time: the job on the cluster bed (benchmarks/multinode.py's `Bench`): predicted two-host step
   at 1 Gbit/s = the measured one-host step (2 ranks on loopback) + the traced bytes a rank sends
   per step (what gloo puts on the wire, section 12's calibration) / 125 MB/s, nothing overlapped (the training code
   overlaps no communication with compute today), against the measured two-host step with host
   1's link shaped to 1 Gbit/s. Rounds of (one host, two hosts), `--steps` each; the step time is
   the median after the warm-up. Needs root (the bed); skipped with a note otherwise.

4. Experts gathered once a step (`--experts`, issue 46): FSDP 2 with the experts their own unit,
   four micro-batches of one row a rank, `parallel.expert_gather` = "micro_batch" and "step":
   rank 0's tracked peak and its bytes per collective category in iteration 2 of a real step, the
   trace's and the closed form's beside them (targets: memory within 10 %, traffic within 5 %).

Ratios are traced / measured (memory, traffic) and measured / predicted (time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from trinity_harness.cluster_bed import bed_unavailable
from trinity_harness.jobs import COMMON as MULTINODE_JOB
from trinity_harness.jobs import CONDITIONS, bench_on_bed, loadavg
from trinity_harness.plan_runs import LAYOUTS, MEMORY_BATCH, measure_rank, measured_config, trace_measured
from trinity_harness.ranks import run_ranks

from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER,
                                            FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE,
                                            sent_by_category)
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.formula import memory_per_rank, traffic_per_rank
from trinity_train.plan.timing import price_measured

ROOT = Path(__file__).resolve().parents[1]

# ~100M parameters (99.4M: 8 x 16 experts of 512 x 512 in 6 MoE layers, hidden 512).
HUNDRED_M = ("--model.hidden_size=512", "--model.num_layers=7", "--model.num_heads=8", "--model.num_kv_heads=4",
             "--model.intermediate_size=2048", "--model.num_experts=16", "--model.moe_intermediate_size=512")
MODELS = {"default": (), "100m": HUNDRED_M}
LINK_GBITS_S = 1.0  # the bed's shaped link
ONE_HOST, ONE_GBIT = CONDITIONS[0][0], "c: 2 hosts, 1 Gbit"
CATEGORIES = (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER, FSDP_EMBEDDING_ROWS_GATHER, FSDP_EMBEDDING_ROWS_REDUCE,
              EP_ALL_TO_ALL, MUON_REDISTRIBUTE)


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def memory_table(models: list[str], work: Path) -> None:
    print("memory of rank 0 at the step's peak (MiB = 2^20 B): traced against a real step "
          f"({' '.join(MEMORY_BATCH)}, --train.compile=false)")
    print("| model | layout | ranks | act. ckpt | traced | formula | tracker on the real step | traced / real | "
          "formula / real | RSS estimate | traced / RSS | RSS growth | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for index, (layout, (world, settings)) in enumerate(LAYOUTS.items()):
            for checkpointing in ("false", "true"):
                overrides = (*MODELS[model], *MEMORY_BATCH, *settings,
                             f"--train.activation_checkpointing={checkpointing}")
                run_dir = work / f"{model}-{index}-{checkpointing}"
                real = run_ranks(world, measure_rank, overrides, run_dir / "run", True, True)[0]
                traced = trace_measured(overrides, run_dir / "trace", world, 0).peak
                cfg = measured_config(overrides, run_dir / "formula")
                formula = memory_per_rank(cfg, ParallelDims.from_config(cfg, world), gpu=False).peak
                tracked = real["tracked_peak"]
                print(f"| {model} | {layout} | {world} | {checkpointing} | {mib(traced)} | {mib(formula)} | "
                      f"{mib(tracked)} | {traced / tracked:.3f} | {formula / tracked:.3f} | "
                      f"{mib(real['rss_peak_estimate'])} | {traced / real['rss_peak_estimate']:.3f} | "
                      f"{mib(real['rss_growth'])} | {loadavg()} |", flush=True)
    print()


def traffic_table(work: Path) -> None:
    print(f"bytes per step by collective (MB = 1e6 B), benchmarks/multinode.py's job ({' '.join(MULTINODE_JOB)}), "
          "2 gloo ranks on loopback, iteration 2")
    real = run_ranks(2, measure_rank, MULTINODE_JOB, work / "traffic", False)
    print("| rank | collective | traced | measured | ratio |")
    print("|---|---|---|---|---|")
    for rank, measured in enumerate(real):
        traced = sent_by_category(trace_measured(MULTINODE_JOB, work / "traffic-trace", 2, rank).collectives)
        for category in CATEGORIES:
            got, want = traced.get(category, 0.0), measured["traffic"].get(category, 0.0)
            print(f"| {rank} | {category} | {got / 1e6:,.3f} | {want / 1e6:,.3f} | {got / want:.3f} |")
    print(f"(load {loadavg()})\n", flush=True)


# Section 4: four micro-batches of one row on each of 2 ranks, the experts sharded over both.
EXPERTS_JOB = ("--parallel.dp_shard=2", "--train.global_batch_size=8", "--train.micro_batch_size=1")


def experts_table(work: Path) -> None:
    print(f"experts gathered once a step against each micro-batch: rank 0 of 2 ranks ({' '.join(EXPERTS_JOB)}), "
          "iteration 2 of a real step (memory in MiB = 2^20 B, traffic in MB = 1e6 B)")
    print("| expert_gather | what | traced | formula | measured | traced / measured | formula / measured | load |")
    print("|---|---|---|---|---|---|---|---|")
    for policy in ("micro_batch", "step"):
        overrides = (*EXPERTS_JOB, f"--parallel.expert_gather={policy}")
        real = run_ranks(2, measure_rank, overrides, work / f"experts-{policy}", True)[0]
        traced = trace_measured(overrides, work / f"experts-{policy}-trace", 2, 0)
        cfg = measured_config(overrides, work / f"experts-{policy}-formula")
        dims = ParallelDims.from_config(cfg, 2)
        formula_sent = sent_by_category(traffic_per_rank(cfg, dims, gpu=False))
        rows = [("peak memory", traced.peak, memory_per_rank(cfg, dims, gpu=False).peak, real["tracked_peak"], mib)]
        traced_sent = sent_by_category(traced.collectives)
        rows += [(category, traced_sent.get(category, 0.0), formula_sent.get(category, 0.0),
                  real["traffic"].get(category, 0.0), lambda x: f"{x / 1e6:,.3f}")
                 for category in CATEGORIES if real["traffic"].get(category)]
        for what, got, predicted, measured, unit in rows:
            print(f"| {policy} | {what} | {unit(got)} | {unit(predicted)} | {unit(measured)} | {got / measured:.3f} | "
                  f"{predicted / measured:.3f} | {loadavg()} |", flush=True)
    print()


def time_check(rounds: int, steps: int, work: Path) -> None:
    reason = bed_unavailable()
    if reason is not None:
        print(f"time check skipped: {reason}")
        return
    calls = trace_measured(MULTINODE_JOB, work / "time-trace", 2, 0).collectives
    # Every byte a rank sends crosses the link (2 hosts x 1 rank).
    link = price_measured(calls, 0.0, LINK_GBITS_S)
    wire_s, wire_bytes = link.comm_s, link.inter_bytes
    print(f"step time of benchmarks/multinode.py's job, --train.steps={steps}: the trace's {wire_bytes / 1e6:.2f} MB "
          f"per step and direction on the wire = {wire_s:.3f} s at "
          f"{LINK_GBITS_S:g} Gbit/s, nothing overlapped")
    ratios = []
    with bench_on_bed() as bench:
        print("| round | one host, 2 ranks: step s | predicted 2 hosts at 1 Gbit s | measured s | measured / predicted | "
              "wire MB per step (host 1 tx / rx) | load |")
        print("|---|---|---|---|---|---|---|")
        for rnd in range(1, rounds + 1):
            one = bench.throughput_job(ONE_HOST, None, steps)
            two = bench.throughput_job(ONE_GBIT, ("rate=1gbit",), steps)
            predicted = one["step_s"] + wire_s
            ratios.append(two["step_s"] / predicted)
            wire = (f"{two['wire_tx_per_step'] / 1e6:.2f} / {two['wire_rx_per_step'] / 1e6:.2f}"
                    if "wire_tx_per_step" in two else "-")
            print(f"| {rnd} | {one['step_s']:.3f} | {predicted:.3f} | {two['step_s']:.3f} | {ratios[-1]:.3f} | {wire} | "
                  f"{one['load_start']} -> {two['load_end']} |", flush=True)
    print(f"median measured / predicted: {statistics.median(ratios):.3f} (target: within 20 %)\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,100m", help="comma-separated: default, 100m")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-traffic", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (one host, two hosts at 1 Gbit)")
    parser.add_argument("--steps", type=int, default=8, help="steps per bed job (the first 3 are warm-up)")
    parser.add_argument("--experts", action="store_true",
                        help="also section 4: the experts gathered once a step against each micro-batch")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(MODELS)}")
    print(f"# load: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="trinity-plan-vs-measured-") as tmp:
        work = Path(tmp)
        if not args.skip_traffic:
            traffic_table(work)
        if not args.skip_memory:
            memory_table(models, work)
        if args.experts:
            experts_table(work)
        if not args.skip_time:
            time_check(args.rounds, args.steps, work)
    print(f"# load after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
