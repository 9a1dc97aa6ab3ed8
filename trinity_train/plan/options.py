"""`trinity-train plan`'s command-line options (argparse; no torch, so `--help` is instant), and
the checks that turn the hardware and pricing options into values or one clear error."""

from __future__ import annotations

import argparse
import math

from trinity_train.errors import ConfigError
from trinity_train.files import user_path
from trinity_train.parallel.node_layout import Nodes
from trinity_train.plan.hardware import (DEFAULT_GPU, DEFAULT_MFU, DEFAULT_NODES, GPUS, Hardware, custom_hardware,
                                         hardware_named)

# The custom GPU's options, in the order custom_hardware takes them, and their units.
CUSTOM_HARDWARE = {"gpu_memory": "GiB", "peak_tflops": "TFLOPS", "intra_gbps": "GB/s one way",
                   "inter_gbps": "Gbit/s"}


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
    parser.add_argument("--gpus-per-node", type=positive_int, default=None,
                        help="GPUs per node: which groups stay inside a node, and tp or ep groups across "
                             "nodes refused as training refuses them (default: parallel.ranks_per_node "
                             "when set, else 8)")
    parser.add_argument("--routing", default="balanced",
                        help="how tokens spread over the experts: 'balanced' or 'skew=F' (the traced rank's "
                             "experts receive F x the mean; default balanced)")
    parser.add_argument("--cpu", action="store_true",
                        help="plan a CPU job with gloo, as this machine's runs (the CPU's attention kernels, DTensor's "
                             "gloo fallbacks) instead of a GPU job; no GPU, so no fit, reserve or step time")
    gpu = parser.add_argument_group("the GPU the job is priced on (memory fit, step time)")
    gpu.add_argument("--gpu", default=None, metavar="NAME",
                     help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU}); the four options below, "
                          "given together, describe another GPU instead")
    gpu.add_argument("--gpu-memory", default=None, metavar="GiB", help="a custom GPU's memory, GiB")
    gpu.add_argument("--peak-tflops", default=None, metavar="T",
                     help="a custom GPU's dense bf16 peak, TFLOPS")
    gpu.add_argument("--intra-gbps", default=None, metavar="B",
                     help="a custom GPU's NVLink bandwidth inside a node, GB/s one way")
    gpu.add_argument("--inter-gbps", default=None, metavar="B",
                     help="a custom GPU's NIC rate across nodes, Gbit/s")
    gpu.add_argument("--mfu", default=None, metavar="F",
                     help=f"model FLOPs utilisation the step time assumes, in (0, 1] (default {DEFAULT_MFU})")
    gpu.add_argument("--hardware", default=None, metavar="PROFILE", type=user_path,
                     help="price on a hardware profile `trinity-train calibrate` measured on the job's nodes instead "
                          "of a datasheet GPU: memory, the measured training-step rate (the MFU is measured, not "
                          "assumed) and each collective by its kind, link and size; a profile of a CPU job (gloo) "
                          "prices a --cpu plan")
    gpu.add_argument("--nodes", default=None, metavar="NAME,NAME",
                     help="the job's node names, checked against --hardware's: a profile of other nodes is refused")
    search = parser.add_argument_group("layout search")
    search.add_argument("--search", action="store_true",
                        help="rank the layouts of --world GPUs that fit the GPU by predicted step time (closed "
                             "form, no trace) and print them as ready overrides; plan the one you pick without "
                             "--search to trace it")
    search.add_argument("--top", default=None, metavar="N", help="how many layouts --search prints (default 10)")
    search.add_argument("--max-cp", default=None, metavar="N",
                        help="--search also splits each row over up to N context-parallel ranks (long "
                             "sequences; default 1: no context parallelism)")
    search.add_argument("--across-nodes", action="store_true",
                        help="--search also proposes layouts whose tp, cp or ep groups span nodes (their "
                             "collectives on the slow link, priced as exposed; configs with "
                             "parallel.allow_ep_tp_across_nodes=true)")
    parser.add_argument("--json", action="store_true", help="print the plan (or the search) as JSON")


def nodes_option(args: argparse.Namespace, ranks_per_node: int, hardware: Hardware | None = None) -> Nodes:
    """The node a plan places its ranks on: --gpus-per-node, else the config's
    `parallel.ranks_per_node` (as training takes it), else a profile's ranks per node, else 8 GPUs.
    A profile measured its links with its own ranks per node sharing them: another count is refused."""
    profile = getattr(hardware, "profile", None)
    if args.gpus_per_node is not None:
        nodes = Nodes(args.gpus_per_node, "--gpus-per-node")
    elif ranks_per_node:
        nodes = Nodes(ranks_per_node, "parallel.ranks_per_node")
    elif profile is not None:
        return Nodes(profile.ranks_per_node, f"--hardware {profile.path}'s ranks per node")
    else:
        return DEFAULT_NODES
    if profile is not None and nodes.ranks != profile.ranks_per_node:
        raise ConfigError(f"{nodes.source} places {nodes.ranks} ranks on a node, but --hardware '{profile.path}' was "
                          f"measured with {profile.ranks_per_node} (its links shared by that many ranks): calibrate "
                          "with the job's ranks per node")
    return nodes


def _number(args: argparse.Namespace, dest: str) -> float:
    text = getattr(args, dest)
    option = "--" + dest.replace("_", "-")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{option} {text!r} is not a number > 0: give it as a plain number of "
                          f"{CUSTOM_HARDWARE[dest]}")
    return value


def hardware_option(args: argparse.Namespace) -> Hardware | None:
    """The GPU `args` name: a calibrated profile (`--hardware`, checked against this torch and the
    plan's kind of job), the four custom values (all or none of them), else `--gpu` (default h200);
    None for a --cpu plan without a profile, which refuses the GPU options."""
    given = [d for d in CUSTOM_HARDWARE if getattr(args, d) is not None]
    if args.hardware is not None:
        return profile_option(args, given)
    if args.nodes is not None:
        raise ConfigError("--nodes names the job's nodes to check a calibrated profile against: add --hardware "
                          "PROFILE, or drop --nodes")
    if args.cpu:
        named = [o for o, v in (("--gpu", args.gpu), ("--mfu", args.mfu), ("--search", args.search or None))
                 if v is not None] + ["--" + d.replace("_", "-") for d in given]
        if named:
            raise ConfigError(f"{', '.join(named)} only apply to a GPU job, but --cpu plans a CPU job: drop "
                              f"--cpu, or drop {', '.join(named)} (a CPU job is priced and searched on a profile "
                              "calibrated on its nodes: --hardware PROFILE)")
        return None
    if given:
        missing = ["--" + d.replace("_", "-") for d in CUSTOM_HARDWARE if d not in given]
        if missing:
            raise ConfigError(f"a custom GPU needs --gpu-memory, --peak-tflops, --intra-gbps and --inter-gbps "
                              f"together; missing {', '.join(missing)} (or name one with --gpu {'|'.join(GPUS)})")
        return custom_hardware(*(_number(args, d) for d in CUSTOM_HARDWARE))
    try:
        return hardware_named(args.gpu or DEFAULT_GPU)
    except ValueError as e:
        raise ConfigError(f"--gpu: {e}") from None


def profile_option(args: argparse.Namespace, given: list[str]) -> Hardware:
    """`--hardware PROFILE` as the plan's hardware; the datasheet options alongside it are refused
    (the profile measured what they would state)."""
    import torch

    from trinity_train.plan.profile import as_hardware, check_profile, load_profile

    named = [o for o, v in (("--gpu", args.gpu), ("--mfu", args.mfu)) if v is not None]
    named += ["--" + d.replace("_", "-") for d in given]
    if named:
        raise ConfigError(f"--hardware prices on what a calibration measured, so {', '.join(named)} would contradict "
                          f"it: drop {', '.join(named)}, or drop --hardware")
    profile = load_profile(args.hardware)
    node_names = [n for n in args.nodes.split(",") if n] if args.nodes else None
    check_profile(profile, torch_version=torch.__version__, cpu_plan=args.cpu, node_names=node_names)
    return as_hardware(profile)


def mfu_option(args: argparse.Namespace, hardware: Hardware | None = None) -> float:
    profile = getattr(hardware, "profile", None)
    if profile is not None:
        return profile.mfu  # measured: the training step's rate over the matmul rate
    if args.mfu is None:
        return DEFAULT_MFU
    try:
        value = float(args.mfu)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ConfigError(f"--mfu {args.mfu!r} must be a fraction in (0, 1] (e.g. 0.4 for 40 % of the peak)")
    return value


def max_cp_option(args: argparse.Namespace) -> int:
    if args.max_cp is None:
        return 1
    if not args.search:
        raise ConfigError("--max-cp only widens --search's layouts: add --search, or set parallel.cp to plan "
                          "one layout with context parallelism")
    try:
        return positive_int(args.max_cp)
    except argparse.ArgumentTypeError:
        raise ConfigError(f"--max-cp {args.max_cp!r} must be a whole number >= 1 (the most ranks a row is "
                          "split over)") from None


def across_nodes_option(args: argparse.Namespace) -> bool:
    if args.across_nodes and not args.search:
        raise ConfigError("--across-nodes only widens --search's layouts: add --search, or set "
                          "parallel.allow_ep_tp_across_nodes=true to plan one such layout")
    return args.across_nodes


def fixed_sizes(overrides: list[str]) -> dict[str, int]:
    """The layout sizes (`search_space.LAYOUT_KEYS`) given explicitly among the command line's
    overrides: `plan --search` keeps them and searches the rest (dp_shard=-1, "what is left",
    fixes nothing)."""
    from trinity_train.config import parse_overrides
    from trinity_train.plan.search_space import LAYOUT_KEYS

    given = parse_overrides(overrides).get("parallel", {})
    return {k: given[k] for k in LAYOUT_KEYS if k in given and given[k] != -1}


def top_option(args: argparse.Namespace) -> int:
    if args.top is None:
        return 10
    if not args.search:
        raise ConfigError("--top only counts --search's layouts: add --search, or drop --top")
    try:
        return positive_int(args.top)
    except argparse.ArgumentTypeError:
        raise ConfigError(f"--top {args.top!r} must be a whole number >= 1 (how many layouts --search "
                          "prints)") from None
