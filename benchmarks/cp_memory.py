"""Context parallelism's memory: the activation peak of one rank at a long sequence, cp = 1, 2, 4
(issue 32: "the activation peak per rank at a long sequence falls about as 1/cp").

    python benchmarks/cp_memory.py [--seq-len 16384] [--cps 1,2,4]

The default model (configs/debug.toml) with document masking on and its 128-token sliding
window, one sequence of `--seq-len` tokens a step (micro-batch 1), trained for real on `cp` gloo
ranks (world = cp: the cp ranks also shard the weights, FSDP over dp_shard x cp). Iteration 2 of
each job is measured by the planner's tracker on the real tensors (`trinity_harness/plan_runs.py`,
`measure_rank`): bytes by category at the iteration's peak, rank 0's. Beside it, what the plan's
closed form (`plan/formula.py`, `memory_per_rank`) predicts for the same layout.

What does not shrink with cp: a global layer gathers every key and value of the sequence (kv
heads x head_dim x T, twice, per global layer), and the weights' share falls with the FSDP group,
not with the sequence. The ratio column is activations at cp = 1 / activations at cp.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table
from trinity_harness.plan_runs import measure_rank, measured_config
from trinity_harness.ranks import run_ranks

from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.formula import memory_per_rank

ROOT = Path(__file__).resolve().parents[1]

MIB = 2 ** 20


def job(seq_len: int, cp: int) -> tuple[str, ...]:
    return (f"--data.seq_len={seq_len}", "--model.doc_masking=true", "--train.micro_batch_size=1",
            "--train.global_batch_size=1", f"--parallel.cp={cp}", "--parallel.dp_shard=1")


def measure(seq_len: int, cp: int, run_dir: Path) -> dict:
    overrides = job(seq_len, cp)
    if cp == 1:
        measured = measure_rank(overrides, run_dir, memory=True)
    else:
        measured = run_ranks(cp, measure_rank, overrides, run_dir, True, timeout_s=1800)[0]
    cfg = measured_config(overrides, run_dir)
    predicted = memory_per_rank(cfg, ParallelDims.from_config(cfg, cp), gpu=False, steady=True)
    return {"tracked": measured["tracked"], "predicted": predicted.by_category}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cps", default="1,2,4", help="comma-separated cp sizes (1 first: the ratios' base)")
    args = parser.parse_args()
    cps = [int(c) for c in args.cps.split(",")]
    print(f"load before: {loadavg()}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in cps:
            rows[cp] = measure(args.seq_len, cp, Path(tmp) / f"cp{cp}")
            print(f"cp={cp} done, load {loadavg()}", flush=True)
    base = rows[cps[0]]["tracked"]["activations"]
    print(f"\nseq_len {args.seq_len}, document masking, window 128, micro-batch 1; rank 0, MiB at the "
          f"iteration's peak")
    table = []
    for cp, row in rows.items():
        t, p = row["tracked"], row["predicted"]
        state = t["parameters"] + t["gradients"] + t["optimizer state"] + t["gathered parameters"]
        table.append([cp, f"{t['activations'] / MIB:,.0f}", f"{base / max(t['activations'], 1):.2f}x",
                      f"{t['temporaries'] / MIB:,.0f}", f"{state / MIB:,.0f}", f"{sum(t.values()) / MIB:,.0f}",
                      f"{p['activations'] / MIB:,.0f}"])
    print(f"load after: {loadavg()}")
    print(markdown_table(["cp", "activations", "ratio", "temporaries", "parameters + gradients + state", "peak",
                          "plan: activations"], table))


if __name__ == "__main__":
    main()
