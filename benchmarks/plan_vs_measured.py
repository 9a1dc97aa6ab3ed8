"""`trinity-train plan`'s trace against what this machine measures (issue 29, "Checked against
what can be measured here"): memory, traffic and step time.

    python benchmarks/plan_vs_measured.py [--models default,100m] [--skip-memory] [--skip-traffic]
                                          [--skip-time] [--rounds 2] [--steps 8] [--experts] [--matmul]

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
3. Time, on calibrated profiles (issue 47): first `trinity-train calibrate` on 2 bed hosts x 2 ranks
   with host 1's link shaped to 1 Gbit/s: its across-node class (a node's 2 ranks at once) against
   the shape and the bed's own one-stream measurement (benchmarks/bed_link.py's `streams`), its
   inside-node (loopback) class apart. Then, each round, for the job of benchmarks/multinode.py
   (`COMMON`, FSDP x EP) on one host x 2 ranks (loopback), 2 hosts x 1 rank at 1 Gbit/s and at
   200 Mbit/s: `calibrate` launched as the job is launched, on the same hosts and link, then
   `trinity-train plan --cpu --hardware PROFILE` predicts the step (the plan's own time model: the
   measured training-step rate, each traced collective priced by the profile's curves, no overlap
   for gloo) and the job runs `--steps` steps (the median after the warm-up). Needs root (the
   bed); skipped with a note otherwise.

4. Experts gathered once a step (`--experts`, issue 46): FSDP 2 with the experts their own unit,
   four micro-batches of one row a rank, `parallel.expert_gather` = "micro_batch" and "step":
   rank 0's tracked peak and its bytes per collective category in iteration 2 of a real step, the
   trace's and the closed form's beside them (targets: memory within 10 %, traffic within 5 %).

5. Matmul rate (`--matmul`): one-process `trinity-train calibrate` against
   benchmarks/train_step_vs_hf.py's matmul probe (`measure.matmul_probe`) at the default model's
   shapes, run right after it in the same thread count (target: within 20 %).

Ratios are traced / measured (memory, traffic) and measured / predicted (time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bed_link import rate_mb_s, streams
from measure import matmul_probe, model_gemm_shapes

from trinity_harness.cluster_bed import bed_unavailable
from trinity_harness.jobs import COMMON as MULTINODE_JOB
from trinity_harness.jobs import PAIR, bench_on_bed, job_environment, loadavg
from trinity_harness.table import markdown_table
from trinity_harness.plan_runs import LAYOUTS, MEMORY_BATCH, measure_rank, measured_config, trace_measured
from trinity_harness.ranks import run_ranks

from trinity_train.plan.collectives import (EP_ALL_TO_ALL, FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER,
                                            FSDP_EMBEDDING_ROWS_REDUCE, FSDP_REDUCE_SCATTER, MUON_REDISTRIBUTE,
                                            sent_by_category)
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.formula import memory_per_rank, traffic_per_rank
from trinity_train.plan.profile import load_profile
from trinity_train.calibrate.compute import weighted_rate
from trinity_train.config import default_config_path
from trinity_train.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[1]

# ~100M parameters (99.4M: 8 x 16 experts of 512 x 512 in 6 MoE layers, hidden 512).
HUNDRED_M = ("--model.hidden_size=512", "--model.num_layers=7", "--model.num_heads=8", "--model.num_kv_heads=4",
             "--model.intermediate_size=2048", "--model.num_experts=16", "--model.moe_intermediate_size=512")
MODELS = {"default": (), "100m": HUNDRED_M}
ONE_HOST, ONE_GBIT, TWO_HUNDRED = "a: 1 host x 2 ranks", "c: 2 hosts, 1 Gbit", "d: 2 hosts, 200 Mbit"
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


CALIBRATE_S = 60.0  # each calibration's --time-limit


def plan_predicted(profile: Path, args: tuple[str, ...]) -> dict:
    """`trinity-train plan --cpu --hardware PROFILE --world 2` of the job (COMMON + `args`): its
    step time (`predicted_s`, `compute_s`, `comm_s`)."""
    done = subprocess.run([sys.executable, "-m", "trinity_train.cli", "plan", "--cpu", "--hardware", str(profile),
                           "--world", "2", *MULTINODE_JOB, *args, "--json"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"plan on {profile}: {done.stderr.strip()}")
    return json.loads(done.stdout)["step_time"]


def link_check(bench, work: Path) -> None:
    """Calibrate 2 hosts x 2 ranks with host 1's link at 1 Gbit/s: the across-node class (both
    ranks of a node through the one link at once) against the shape and the bed's own one stream
    (benchmarks/bed_link.py), the inside-node (loopback) class apart."""
    out = work / "link-check.json"
    run = bench.calibrate_nodes("link check", ("rate=1gbit",), out, ranks_per_host=2,
                                args=("--train.global_batch_size=16",), time_limit=CALIBRATE_S)
    profile = load_profile(out)
    bench.shape(("rate=1gbit",))
    try:
        one_stream = streams(bench.bed, [(0, 1)], 256)[0]
    finally:
        bench.bed.shape(1, "off")
    shape = rate_mb_s("1gbit")
    across = profile.link_bandwidth("across") * profile.ranks_per_node / 1e6  # a node's ranks at once
    inside = profile.link_bandwidth("inside") / 1e6
    print("calibrate on 2 hosts x 2 ranks, host 1's link shaped to 1 Gbit/s (one-way send at its largest size; MB = 1e6 B)")
    print(markdown_table(
        ["class", "measured MB/s", "shape MB/s", "measured / shape", "one stream MB/s (bed_link)",
         "measured / one stream", "calibrate s (limit)", "load"],
        [["across nodes, a node (2 ranks at once)", f"{across:.1f}", f"{shape:.1f}", f"{across / shape:.3f}",
          f"{one_stream:.1f}", f"{across / one_stream:.3f}", f"{profile.seconds:.1f} ({profile.time_limit_s:g})",
          loadavg()],
         ["inside a node (loopback), a rank", f"{inside:.1f}", "-", "-", "-", "-", "", ""]]))
    print(f"wall time of the launchers: {run['seconds']:.1f} s (torchrun's start included)\n")


def time_check(rounds: int, steps: int, work: Path) -> None:
    """The plan's predicted step on a profile calibrated on the job's own hosts (one host x 2 ranks;
    2 hosts x 1 rank at each shaped rate) against the job's measured step (section 3 of the doc)."""
    reason = bed_unavailable()
    if reason is not None:
        print(f"time check skipped: {reason}")
        return
    cases = ((ONE_HOST, None), (ONE_GBIT, ("rate=1gbit",)), (TWO_HUNDRED, ("rate=200mbit",)))
    with bench_on_bed() as bench:
        link_check(bench, work)
        rows, ratios = [], {name: [] for name, _ in cases}
        for rnd in range(1, rounds + 1):
            for name, shaped in cases:
                out = work / f"profile-{rnd}-{name.split(':')[0]}.json"
                bench.calibrate_nodes(name, shaped, out, args=PAIR.args, time_limit=CALIBRATE_S)
                plan = plan_predicted(out, PAIR.args)
                measured = bench.throughput_job(name, shaped, steps)
                ratio = measured["step_s"] / plan["predicted_s"]
                ratios[name].append(ratio)
                rows.append([str(rnd), name, f"{plan['compute_s']:.3f}", f"{plan['comm_s']:.3f}",
                             f"{plan['predicted_s']:.3f}", f"{measured['compute_s']:.3f}", f"{measured['step_s']:.3f}",
                             f"{ratio:.3f}", f"{measured['load_start']} -> {measured['load_end']}"])
                print(" | ".join(rows[-1]), flush=True)
    print(f"step time of benchmarks/multinode.py's job, --train.steps={steps}: `plan --cpu --hardware PROFILE` "
          "(profile calibrated just before on the same hosts, same link) against the measured median step")
    print(markdown_table(["round", "condition", "predicted compute s", "predicted comm s", "predicted step s",
                          "measured compute s (rank stats)", "measured step s", "measured / predicted", "load"], rows))
    for name, values in ratios.items():
        print(f"{name}: median measured / predicted {statistics.median(values):.3f} (target: within 20 %)")
    print()


def matmul_check(work: Path) -> None:
    """One process: calibrate's matmul rate at the default model's shapes against
    benchmarks/train_step_vs_hf.py's matmul probe at the same shapes, run right after it."""
    out = work / "one-process.json"
    env = {**job_environment(), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([sys.executable, "-m", "trinity_train.cli", "calibrate", f"--out={out}",
                           "--time-limit=30"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate: {done.stderr.strip()}")
    profile = load_profile(out)
    cfg = load_run_config(default_config_path(), [])
    shapes = model_gemm_shapes(cfg.model, cfg.train.micro_batch_size * cfg.data.seq_len, cfg.model.loss_chunk_tokens)
    probe = matmul_probe(shapes, torch.float32, torch.device("cpu"), repeats=20)
    at_shapes = weighted_rate({s: probe.flops[s] for s in shapes})
    print(f"one process, {torch.get_num_threads()} thread(s): the default model's {len(shapes)} matmul shapes")
    print(markdown_table(["", "calibrate GFLOP/s", "train_step_vs_hf probe GFLOP/s", "calibrate / probe", "load"],
                         [["at the shapes (FLOP-weighted)", f"{profile.matmul_flops / 1e9:.1f}",
                           f"{at_shapes / 1e9:.1f}", f"{profile.matmul_flops / at_shapes:.3f}", loadavg()],
                          ["2048^3", f"{profile.peak_flops / 1e9:.1f}", f"{probe.flops[(2048,) * 3] / 1e9:.1f}",
                           f"{profile.peak_flops / probe.flops[(2048,) * 3]:.3f}", ""]]))
    print()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,100m", help="comma-separated: default, 100m")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-traffic", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of (calibrate + job) on one host, two hosts at 1 Gbit and at 200 Mbit")
    parser.add_argument("--steps", type=int, default=8, help="steps per bed job (the first 3 are warm-up)")
    parser.add_argument("--experts", action="store_true",
                        help="also section 4: the experts gathered once a step against each micro-batch")
    parser.add_argument("--matmul", action="store_true",
                        help="also section 5: calibrate's matmul rate against train_step_vs_hf.py's probe (one process)")
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
        if args.matmul:
            matmul_check(work)
        if not args.skip_time:
            time_check(args.rounds, args.steps, work)
    print(f"# load after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
