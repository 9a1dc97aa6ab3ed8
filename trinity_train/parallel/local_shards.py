"""Run a module's own single-device code on the local shards of its DTensor parameters.

Tensor and expert parallelism store some parameters as DTensors (so FSDP, the optimizer and
checkpoints see their global shape and placement), while the model code that uses them is plain
PyTorch: `torch._grouped_mm` over stacked experts, a per-head scale multiplied into local heads.
`wrap_forward` lets a parallel style put code around a module's forward without renaming it (the
module keeps its parameter names, as FSDP2's own class swap does), and `local_shards` hands that
forward plain local tensors for one call. `to_local()` is differentiable, so gradients still
arrive on the DTensor parameters, as shards of the global gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch import nn
from torch.distributed.tensor import DTensor

# around(module, forward, *args, **kwargs) -> output, where forward is the original bound forward
Around = Callable[..., Any]


def wrap_forward(module: nn.Module, around: Around, prefix: str) -> None:
    """Make `module(*args)` run `around(module, original_forward, *args)` for this instance only."""
    cls = type(module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return around(self, super(wrapped, self).forward, *args, **kwargs)

    wrapped = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
    module.__class__ = wrapped


@contextmanager
def local_shards(module: nn.Module) -> Iterator[None]:
    """Within the block, the module's direct DTensor parameters read as their local shards."""
    saved = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        for name, p in saved.items():
            # Assigned straight into _parameters (as FSDP2 swaps its sharded/unsharded views).
            module._parameters[name] = p.to_local()
        yield
    finally:
        module._parameters.update(saved)
