"""Decisions one process makes for a whole job: rank 0 (the coordinator) changes shared files and
decides, every rank gets its answer. Without torch.distributed there is one process, which is rank 0."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from trinity_train.errors import UserError


def is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def decided_by_rank_zero(decide: Callable[[], Any]) -> Any:
    """`decide()` on rank 0, its result on every rank (one process: just `decide()`). A UserError
    on rank 0 is raised on every rank (the same class and message), so none of them waits for the
    others."""
    if not dist.is_initialized():
        return decide()
    box: list[Any] = [None]
    refusal: UserError | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except UserError as e:
            refusal = e
            box[0] = ("error", (type(e), str(e)))
    dist.broadcast_object_list(box, src=0)
    outcome, value = box[0]
    if refusal is not None:
        raise refusal
    if outcome == "error":
        error_class, message = value
        raise error_class(message)
    return value
