"""`trinity-train plan`'s command-line options (argparse; no torch, so `--help` is instant)."""

from __future__ import annotations

import argparse

from trinity_train.files import user_path


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=user_path, help="TOML config file (default: configs/debug.toml)")
    parser.add_argument("--world", type=positive_int, default=None,
                        help="ranks (GPUs) of the job (default: the config's parallel sizes, with "
                             "dp_shard=-1 counted as 1)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="GPUs per node: which groups stay inside a node (default 8)")
    parser.add_argument("--routing", default="balanced",
                        help="how tokens spread over the experts: 'balanced' or 'skew=F' (the traced rank's "
                             "experts receive F x the mean; default balanced)")
    parser.add_argument("--cpu", action="store_true",
                        help="plan a CPU job with gloo, as this machine's runs (the CPU's attention kernels, DTensor's "
                             "gloo fallbacks) instead of a GPU job")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
