"""`trinity-train plan`: load the config, plan the job, print the tables (or JSON); with
`--search`, rank the layouts that fit by the closed form instead (no trace)."""

from __future__ import annotations

import argparse
import json
import sys

from trinity_train import exit_codes
from trinity_train.config import default_config_path
from trinity_train.errors import ConfigError
from trinity_train.parallel.assumed_routing import parse_routing
from trinity_train.plan.hardware import CPU_RESERVE, DEFAULT_RESERVE, PROFILE_RESERVE
from trinity_train.plan.options import (across_nodes_option, fixed_sizes, hardware_option, max_cp_option, mfu_option,
                                        nodes_option, top_option)


def run_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from trinity_train.run_config import load_run_config

    # Every option is checked before the config is loaded or anything traced.
    hardware = hardware_option(args)
    mfu, top, max_cp = mfu_option(args, hardware), top_option(args), max_cp_option(args)
    across_nodes = across_nodes_option(args)
    try:
        routing = parse_routing(args.routing)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    config = args.config or default_config_path()
    cfg = load_run_config(config, overrides)
    world = args.world or _world_from_layout(cfg)
    nodes = nodes_option(args, cfg.parallel.ranks_per_node, hardware)
    # A CPU job (a gloo profile) holds no CUDA context or NCCL buffers besides its tensors; a GPU
    # profile's memory was measured with the context made.
    reserve = CPU_RESERVE if args.cpu else PROFILE_RESERVE if args.hardware else DEFAULT_RESERVE

    if args.search:
        from trinity_train.plan.report import render_search, search_summary
        from trinity_train.plan.search import search

        # Layout sizes given on the command line are kept, the others searched.
        found = search(cfg, world, hardware, nodes=nodes, top=top, mfu=mfu, routing=routing, max_cp=max_cp,
                       fixed=fixed_sizes(overrides), across_nodes=across_nodes, gpu=not args.cpu, reserve=reserve)
        data = search_summary(cfg, world, hardware, found, gpus_per_node=nodes.ranks, mfu=mfu,
                              routing=routing, config=str(config))
        print(json.dumps(data, indent=1) if args.json else render_search(data))
        return exit_codes.DONE

    import logging
    import warnings

    from trinity_train.plan.job import plan_job
    from trinity_train.plan.report import render, summary

    # FSDP and DTensor warn about things a trace does on purpose (views out of an FSDP unit, the
    # CPU mesh's all-to-all fallback): not the user's business here.
    warnings.filterwarnings("ignore", module=r"torch\..*")
    logging.getLogger("torch").setLevel(logging.ERROR)

    def progress(message: str) -> None:
        if not args.json:
            print(f"# {message}", file=sys.stderr, flush=True)

    plan = plan_job(cfg, world, nodes=nodes, gpu=not args.cpu, routing=routing,
                    progress=progress)
    data = summary(plan, hardware, mfu, reserve)
    print(json.dumps(data, indent=1) if args.json else render(data))
    return exit_codes.DONE


def _world_from_layout(cfg) -> int:
    """Without --world: the config's fixed layout, or one process where dp_shard = -1 leaves the
    world open."""
    p = cfg.parallel
    return p.dp_replicate * p.cp * p.tp * (p.dp_shard if p.dp_shard != -1 else 1)
