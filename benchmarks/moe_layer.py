"""Is our MoE layer efficient? Forward + backward time of one MoE layer (router, shared expert,
sorted dispatch, grouped-GEMM routed experts, weighted combine) against a dense SwiGLU FFN that
does the same active matmul FLOPs per token, side by side, best of several repetitions.

The dense width is the active width of the MoE (shared width + top-k * expert width) plus the
router's share; the ratio MoE time / dense time is what routing costs on top of the matmuls
(target: at most 1.3).

    python benchmarks/moe_layer.py [--config configs/bench_cpu.toml] [--repeats 10] [--dtype fp32]
        [--a.b=value ...]
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads that spin at every barrier while a core is
# taken stall each operator (steps measured 2-10x slower and erratic on the 2-core machine of
# benchmarks/README.md). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from measure import Timings, timed
from trinity_harness.table import markdown_table, ratio
from trinity_train.config import load_config
from trinity_train.model.moe import FeedForward, MoE

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.3


def dense_equivalent_width(m) -> int:
    """Width of a SwiGLU whose 3*d*width matmul FLOPs per token equal the MoE's active ones
    (shared expert, top-k routed experts and the d x E router)."""
    active = (m.num_shared_experts + m.num_experts_per_tok) * m.moe_intermediate_size
    return active + round(m.num_experts / 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "bench_cpu.toml")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile both layers (default: the config's train.compile)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    m = cfg.model
    device = torch.device("cpu")
    torch.manual_seed(0)

    moe = MoE(m, "silu").to(device)
    width = dense_equivalent_width(m)
    dense = FeedForward(m.hidden_size, width, "silu").to(device)
    for module in (moe, dense):
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
    moe.reset_parameters()  # the expert-bias buffers
    compiled = cfg.train.compile if args.compile is None else args.compile
    if compiled:  # as the trainer compiles blocks; the routed experts themselves stay eager
        moe.compile()
        dense.compile()
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    x = torch.randn(cfg.train.micro_batch_size, cfg.data.seq_len, m.hidden_size, device=device,
                    requires_grad=True)
    grad = torch.randn_like(x)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())

    def run_moe():
        with autocast:
            out, _ = moe(x)
        out.backward(grad)

    def run_dense():
        with autocast:
            out = dense(x)
        out.backward(grad)

    timings = {"moe": Timings(), "dense": Timings()}
    runs = {"moe": run_moe, "dense": run_dense}
    for name, fn in runs.items():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():
            timings[name].add(timed(fn, device)[0])

    d = m.hidden_size
    flops = {"moe": 6 * tokens * (3 * d * (m.num_shared_experts + m.num_experts_per_tok)
                                  * m.moe_intermediate_size + d * m.num_experts),
             "dense": 6 * tokens * 3 * d * width}
    print(f"one layer, {tokens} tokens, d={d}, {args.dtype}{', compiled' if compiled else ''}, "
          f"{torch.get_num_threads()} threads, forward + backward, best of {args.repeats}:")
    print(f"  MoE ({m.num_experts} experts, top-{m.num_experts_per_tok}, width {m.moe_intermediate_size}, "
          f"{m.num_shared_experts} shared): {timings['moe'].best * 1e3:8.1f} ms  "
          f"{flops['moe'] / timings['moe'].best / 1e9:6.1f} GFLOP/s")
    print(f"  dense SwiGLU (width {width}, same active FLOPs):   {timings['dense'].best * 1e3:8.1f} ms  "
          f"{flops['dense'] / timings['dense'].best / 1e9:6.1f} GFLOP/s")
    moe_over_dense = timings["moe"].best / timings["dense"].best
    verdict = "ok" if moe_over_dense <= TARGET_RATIO else f"ABOVE the {TARGET_RATIO} target"
    print(f"MoE / dense time = {moe_over_dense:.2f}  {verdict}")
    labels = {"moe": f"MoE ({m.num_experts} experts, top-{m.num_experts_per_tok}, width {m.moe_intermediate_size}, "
                     f"{m.num_shared_experts} shared)",
              "dense": f"dense SwiGLU (width {width}, same active FLOPs)"}
    print(markdown_table(
        ["layer", f"best ms of {args.repeats} (fwd + bwd)", "GFLOP/s", "time ratio to dense"],
        [[labels[name], f"{timings[name].best * 1e3:.1f}", f"{flops[name] / timings[name].best / 1e9:.1f}",
          ratio(timings[name].best, timings["dense"].best)] for name in ("moe", "dense")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
