"""`trinity-train plan`'s command-line options (argparse; no torch, so `--help` is instant)."""

from __future__ import annotations

import argparse

from trinity_train.files import user_path

GPU_NAMES = ("h100", "h200", "b200", "b300")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=user_path, help="TOML config file (default: configs/debug.toml)")
    parser.add_argument("--world", type=positive_int, default=None,
                        help="ranks (GPUs) of the job (default: the config's layout with dp_shard=-1 needs it; "
                             "one process otherwise)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="GPUs per node: which groups stay inside a node (default 8)")
    parser.add_argument("--gpu", choices=GPU_NAMES, default="h100",
                        help="the GPU model: memory, peak bf16 FLOP/s, NVLink and NIC rates (default h100)")
    parser.add_argument("--gpu-memory", type=positive_float, metavar="GiB", help="override: GPU memory in GiB")
    parser.add_argument("--peak-tflops", type=positive_float, metavar="T", help="override: dense bf16 TFLOP/s")
    parser.add_argument("--intra-gbps", type=positive_float, metavar="B",
                        help="override: bandwidth inside a node per GPU, GB/s (one direction)")
    parser.add_argument("--inter-gbps", type=positive_float, metavar="B",
                        help="override: bandwidth across nodes per GPU, Gbit/s")
    parser.add_argument("--mfu", type=positive_float, default=None,
                        help="model FLOPs utilisation the compute time assumes (default: the hardware table's)")
    parser.add_argument("--routing", default="balanced",
                        help="how tokens spread over the experts: 'balanced' or 'skew=F' (the traced rank's "
                             "experts receive F x the mean; default balanced)")
    parser.add_argument("--cpu", action="store_true",
                        help="plan a CPU job with gloo (fp32, as this machine's runs) instead of GPUs")
    parser.add_argument("--search", action="store_true",
                        help="also rank the layouts that fit (closed form), printed as ready overrides")
    parser.add_argument("--top", type=positive_int, default=5, help="layouts --search prints (default 5)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
