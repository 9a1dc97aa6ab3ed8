"""`trinity-train plan`: load the config, plan the job, print the tables (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from trinity_train import exit_codes
from trinity_train.config import default_config_path
from trinity_train.errors import ConfigError
from trinity_train.parallel.assumed_routing import parse_routing


def run_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from trinity_train.run_config import load_run_config

    cfg = load_run_config(args.config or default_config_path(), overrides)
    try:
        routing = parse_routing(args.routing)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    world = args.world or _world_from_layout(cfg)

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

    plan = plan_job(cfg, world, gpus_per_node=args.gpus_per_node, gpu=not args.cpu, routing=routing,
                    progress=progress)
    data = summary(plan)
    print(json.dumps(data, indent=1) if args.json else render(data))
    return exit_codes.DONE


def _world_from_layout(cfg) -> int:
    p = cfg.parallel
    if p.dp_shard == -1:
        raise ConfigError("--world is needed: parallel.dp_shard=-1 takes what is left of the world "
                          "(e.g. trinity-train plan --config configs/nano.toml --world 512)")
    return p.dp_replicate * p.dp_shard * p.tp
