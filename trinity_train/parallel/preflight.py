"""Check a run's parallel layout for a world size before any process starts.

    python -m trinity_train.parallel.preflight [--print-init-timeout] [--ranks-per-node N] WORLD_SIZE
        [--config FILE] [--section.key=value ...]

The launchers call this first, so an impossible layout (a world size that is not the product, a
tp that does not divide the heads, an ep that does not divide the experts or dp_shard, with
--ranks-per-node a tp or ep group that would span nodes: `node_layout`) ends with
the same one-line `error:` the CLI prints and exit code 2, instead of every rank failing under
torchrun. The ranks check again when they start (`init_distributed`). With --print-init-timeout
it prints `parallel.init_timeout_s`, which bounds how long `launch/multinode.sh` waits for the head.
"""

from __future__ import annotations

import argparse
import sys

from trinity_train.config import default_config_path, load_config
from trinity_train.errors import UserError
from trinity_train.parallel.node_layout import layout_on_nodes, nodes_for


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="preflight", allow_abbrev=False)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--config")
    parser.add_argument("--print-init-timeout", action="store_true")
    parser.add_argument("--ranks-per-node", type=int, default=0)
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config or default_config_path(), overrides)
        nodes = nodes_for(cfg.parallel, args.ranks_per_node, "the launcher's processes per node")
        layout_on_nodes(cfg, args.world_size, nodes)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    if args.print_init_timeout:
        print(cfg.parallel.init_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
