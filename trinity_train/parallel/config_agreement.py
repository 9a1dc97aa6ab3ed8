"""Every rank of a job must run the same configuration.

Each node's launcher parses its own command line, so a node started with other arguments (another
`--train.steps`, a stale config file on one machine) would otherwise train a different job in
lock-step until something diverges silently. At start, after the process group is joined and
before anything is built, the ranks gather their resolved configs (one small gather) and all of
them refuse a difference with the same message, naming the first differing key and two ranks
with their hosts.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from trinity_train.config import Config, config_differences, config_to_dict
from trinity_train.errors import ConfigError


def require_same_config(cfg: Config) -> None:
    """Raise the same ConfigError on every rank when any rank's config differs from rank 0's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = (config_to_dict(cfg), socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference, reference_host = everyone[0]
    for rank, (theirs, host) in enumerate(everyone):
        differences = config_differences(reference, theirs)
        if differences:
            key, ours, other = differences[0]
            more = f" (and {len(differences) - 1} more keys)" if len(differences) > 1 else ""
            raise ConfigError(
                f"the nodes were started with different configs: {key} is {other!r} on rank {rank} "
                f"(host {host}) but {ours!r} on rank 0 (host {reference_host}){more}; start every "
                f"node with the same --config and overrides")
