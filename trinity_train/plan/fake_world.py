"""Being one rank of a large job inside this process: torch's fake process group, and the few
switches that make a CPU-hosted trace behave as the job's GPUs would.

- `fake_world(N, r)`: `init_process_group("fake")` as rank r of N; collectives move no data and
  return at once, so the real mesh, FSDP, DTensor and EP code runs unchanged (left on exit).
- `gpu_collectives_and_kernels()`: DTensor sends a redistribute between two shardings as an all-to-all on
  NCCL, but as all-gather + chunk on a CPU mesh (gloo has no all-to-all there,
  torch/distributed/tensor/_collective_utils.py); a plan for GPUs takes the NCCL path.
- `gpu_kernels()`: the model picks the GPU's attention path (`kernel_device`), and SDPA runs
  as the fused GPU kernels it would pick there (flash attention for causal attention without a
  mask, memory-efficient attention with a mask), whose fake kernels allocate what the GPU
  kernels do (the output and its log-sum-exp, no T x T scores); a CPU trace would take the
  CPU's math path and hold every score matrix.
- `sharding_metadata_apart()`: DTensor's shape propagation out of the trace's fake mode, as
  in a real run (the memory tracker counted its global-shape tensors).
- `CpuGroupedMatmul`: the fake (meta) kernel of `torch._grouped_mm` enforces the CUDA kernel's
  bf16-only rule; the CPU kernel takes fp32 as well, so an fp32 trace (a CPU run's plan) gets
  the output shape the CPU kernel gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._meta_registrations import _create_grouped_mm_output_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from trinity_train.kernel_device import kernels_of

import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of the c10d ops)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a plan runs in a process of its own: a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_sharding_decisions()


def forget_sharding_decisions() -> None:
    """DTensor caches its sharding and redistribution decisions by mesh, and a mesh of the next
    trace compares equal to this one's while naming other process groups (names restart at 0 in
    each world, in the order that trace created them): a cached decision would then send a
    collective to a group of the dead world ("Could not resolve the process group")."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


@contextlib.contextmanager
def gpu_collectives_and_kernels(enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    # `local_tensor_mode()` is read by that module only to pick the CPU fallback.
    with mock.patch("torch.distributed.tensor._collective_utils.local_tensor_mode", lambda: True), \
            mock.patch("torch.nn.functional.scaled_dot_product_attention", gpu_attention), kernels_of("cuda"):
        yield


def gpu_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` as a GPU runs it: flash attention (GQA native) when there
    is no mask, else memory-efficient attention with the boolean mask turned into an additive
    bias, as SDPA does on CUDA."""
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    bias = attn_mask
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                  scale=scale)[0]


@contextlib.contextmanager
def sharding_metadata_apart() -> Iterator[None]:
    """DTensor derives an op's output shape by running it on fake tensors of the *global* shapes;
    it reuses the fake mode in force, which in a trace is the trace's own, so the memory tracker
    counted those global-shape tensors as the rank's (2 x the sharded gradients at the gradient
    norm: the 100M model's FSDP peak 23 % high). In a real run they live in a fake mode of their
    own, which the tracker skips; so here."""
    with mock.patch("torch.distributed.tensor._sharding_prop.detect_fake_mode", lambda: None):
        yield


class CpuGroupedMatmul(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            return _create_grouped_mm_output_tensor(args[0], args[1], offs, kwargs.get("out_dtype") or args[0].dtype)
        return func(*args, **kwargs)
