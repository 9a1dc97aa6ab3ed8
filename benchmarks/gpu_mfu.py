"""Tokens/s and MFU of the trainer's own training step on one GPU, for a Nano-shaped model: the
released Nano widths (configs/nano.toml: d=1024, 128 experts top-8, vocabulary 200192, sequence
4096) with fewer layers, bf16 autocast, the config's optimizer, compile and activation
checkpointing settings.

MFU = tokens/s * training_flops_per_token (the trainer's accounting) / the GPU's dense bf16 peak
(its data-sheet figure, or --peak-tflops); a measured large bf16 matmul is printed alongside.
Runs as one command on any GPU machine:

    python benchmarks/gpu_mfu.py [--layers 6] [--steps 10] [--warmup 3] [--peak-tflops 989]
        [--json result.json] [--a.b=value ...]         e.g. --train.compile=false --optim.name=adamw

(`--device cpu` runs the same code on the CPU, against the CPU's measured bf16 matmul peak; for
smoke tests with small overrides.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from measure import Timings, matmul_probe, step_flops, timed
from trinity_harness.table import markdown_table
from trinity_train.config import load_config
from trinity_train.model.counting import count_parameters
from trinity_train.optim.groups import build_optimizer
from trinity_train.optim.schedule import build_scheduler
from trinity_train.stability import StepGuard
from trinity_train.step import TrainingStep
from trinity_train.train import build_model_for_training

ROOT = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peaks (no sparsity) from the vendors' data sheets, in TFLOP/s; the first
# name that occurs in torch.cuda.get_device_name() wins.
BF16_PEAK_TFLOPS = [
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4),
    ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L4", 121.0),
    ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2), ("MI300X", 1307.4), ("MI250X", 383.0),
]


def data_sheet_peak(device: torch.device) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for key, tflops in BF16_PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12, name
    return None, name


@dataclass
class Batch:
    """What TrainingStep reads from a loader batch."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "nano.toml")
    parser.add_argument("--layers", type=int, default=6, help="layers (the config's dense layers included)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args, overrides = parser.parse_known_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no GPU is visible; this benchmark measures one GPU (--device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    cfg = load_config(args.config, [f"--model.num_layers={args.layers}", "--train.dtype=bf16",
                                    f"--train.device={device.type}", "--train.grad_accum=1",
                                    *overrides])

    peak, device_name = data_sheet_peak(device)
    if args.peak_tflops > 0:
        peak = args.peak_tflops * 1e12
    probe_size = 8192 if device.type == "cuda" else 1024
    measured = matmul_probe([], torch.bfloat16, device, repeats=10, square=probe_size).peak
    if peak is None:
        if device.type == "cuda":
            print(f"note: no data-sheet peak known for '{device_name}'; MFU is against the measured "
                  "matmul (give --peak-tflops for the data-sheet figure)")
        peak = measured

    model = build_model_for_training(cfg, device)
    optimizer = build_optimizer(model, cfg.optim)
    step = TrainingStep(model, optimizer, build_scheduler(optimizer, cfg), StepGuard(cfg.stability),
                        cfg, device)
    generator = torch.Generator(device=device).manual_seed(cfg.data.seed)
    rows = cfg.train.micro_batch_size
    timings = Timings()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1), device=device,
                               generator=generator)
        batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        seconds, result = timed(lambda: step(batch, i + 1, i), device)
        if i >= args.warmup:
            timings.add(seconds)
        print(f"  step {i}: loss {result.loss:.4f}, {seconds:.3f} s"
              + (" (warm-up)" if i < args.warmup else ""), flush=True)

    tokens_per_step = rows * cfg.data.seq_len
    flops = step_flops(cfg)
    counts = count_parameters(cfg.model)
    tokens_per_s = tokens_per_step / timings.median
    result = {
        "device": device_name, "layers": cfg.model.num_layers, "tokens_per_step": tokens_per_step,
        "params_total": counts.total, "params_active": counts.active,
        "flops_per_token": flops / tokens_per_step, "step_s_median": timings.median,
        "step_s_best": timings.best, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / tokens_per_step / peak, "peak_flops": peak,
        "measured_matmul_flops": measured,
        "mfu_vs_measured_matmul": tokens_per_s * flops / tokens_per_step / measured,
        "compile": cfg.train.compile, "activation_checkpointing": cfg.train.activation_checkpointing,
        "optimizer": cfg.optim.name,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                            else None),
    }
    print(f"{device_name}: Nano widths, {cfg.model.num_layers} layers "
          f"({counts.total / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active), "
          f"{rows}x{cfg.data.seq_len} tokens/step, bf16, compile={cfg.train.compile}, "
          f"activation checkpointing={cfg.train.activation_checkpointing}, {cfg.optim.name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    memory = "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f}"
    print(markdown_table(
        ["device", "layers", f"tokens/s (median of {args.steps})", "tokens/s (best)", "s/step (median)",
         f"MFU of {peak / 1e12:.0f} TFLOP/s bf16 peak",
         f"MFU of a measured {probe_size}^3 bf16 matmul ({measured / 1e12:.0f} TFLOP/s)", "peak memory GiB"],
        [[device_name, cfg.model.num_layers, f"{tokens_per_s:,.0f}", f"{tokens_per_step / timings.best:,.0f}",
          f"{timings.median:.3f}", f"{result['mfu']:.1%}", f"{result['mfu_vs_measured_matmul']:.1%}", memory]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
