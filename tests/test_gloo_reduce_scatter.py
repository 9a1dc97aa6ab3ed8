"""FSDP's reduce-scatter on gloo (`parallel/gloo/reduce_scatter.py`): half the bytes, the same sums.

- On two gloo ranks `AllToAllReduceScatter` gives bitwise what gloo's own reduce-scatter (a clone,
  an all-reduce and a chunk) gives, on bare tensors and on the gradients of a real FSDP backward.
- On four ranks the sums agree to float32 rounding only: gloo's ring starts each chunk's sum at a
  different rank, the local sum always at rank 0.
- What a rank writes to its sockets per reduce-scatter (the process's `wchar`, /proc/self/io:
  gloo's TCP transport writes with writev) halves on two ranks: (n-1)/n of the input instead of
  2(n-1)/n. The planner's `CollectiveLog` files the all-to-all under FSDP reduce-scatter with the
  bytes it credits a reduce-scatter.
- With bf16 on the wire (`parallel.reduce_wire_dtype = "bf16"`) each rank writes half of that
  again, and the result is bit for bit the fp32 sum, in rank order, of every rank's bf16-rounded
  chunk, computed here by hand (not gloo's bf16 sum, which rounds the sum too), overlapped or not,
  on bare tensors and in an FSDP backward; under HSDP FSDP's all-reduce across the replicas sends
  bf16 and sums in bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from conftest import TINY_MODEL
from trinity_harness.ranks import init_gloo
from tiny_fsdp import tiny_fsdp_model
from trinity_train.config import load_config
from trinity_train.parallel.gloo.embedding_reduce_scatter import TouchedRowsReduceScatter
from trinity_train.parallel.gloo.reduce_scatter import AllToAllReduceScatter
from trinity_train.plan.collectives import (FSDP_ALL_GATHER, FSDP_ALL_REDUCE, FSDP_EMBEDDING_ROWS_GATHER,
                                            FSDP_REDUCE_SCATTER, CollectiveLog, sent_by_category)

SIZES = (4 * 3, 4 * 1001, 4 * 2**16)  # elements (divisible by 2 and 4 ranks)


def _inputs(numel: int, rank: int | None = None) -> torch.Tensor:
    """Rank `rank`'s (this rank's) reduce-scatter input of `numel` elements."""
    g = torch.Generator().manual_seed(1000 * (dist.get_rank() if rank is None else rank) + numel)
    return torch.randn(numel, generator=g) * 10 ** torch.randint(-3, 4, (numel,), generator=g)


def _both_sums() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gloo's reduce-scatter, the all-to-all one) of the same inputs, for each of SIZES."""
    init_gloo()
    n, results = dist.get_world_size(), []
    for numel in SIZES:
        x = _inputs(numel)
        theirs, ours = torch.empty(numel // n), torch.empty(numel // n)
        dist.reduce_scatter_single(theirs, x.clone())
        AllToAllReduceScatter()(ours, x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        results.append((theirs, ours))
    return results


def test_two_ranks_sum_bitwise_as_gloo_does(rank_pool):
    for rank, results in enumerate(rank_pool(2).run(_both_sums)):
        for numel, (theirs, ours) in zip(SIZES, results):
            assert torch.equal(ours, theirs), f"rank {rank}, {numel} elements"


@pytest.mark.slow  # a pool of four ranks (~9 s); the two-rank bitwise test stays in the fast loop
def test_four_ranks_sum_to_float_rounding(rank_pool):
    for rank, results in enumerate(rank_pool(4).run(_both_sums)):
        for numel, (theirs, ours) in zip(SIZES, results):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())


def _touched_rows_sums() -> list[dict]:
    """The embedding's reduce-scatter (`TouchedRowsReduceScatter`) against the dense all-to-all one
    on a [rows, 32] gradient whose rows are mostly zero (different ones on each rank; one touched
    row holds -0.0 elements, one is all -0.0), fp32 and bf16 on the wire: both outputs and the bytes
    this rank wrote to its sockets for each."""
    init_gloo()
    n, me, width, results = dist.get_world_size(), dist.get_rank(), 32, []
    for wire in (None, torch.bfloat16):
        x = _inputs(n * 96 * width).view(-1, width)
        g = torch.Generator().manual_seed(me)
        x[torch.rand(len(x), generator=g) > 0.1] = 0.0  # about a tenth of the rows touched
        x[3, :5], x[4] = -0.0, -0.0
        out = {}
        for name, comm in (("dense", AllToAllReduceScatter(wire)), ("touched", TouchedRowsReduceScatter(width, wire))):
            output = torch.empty(x.numel() // n)
            dist.barrier()
            before = _socket_bytes_written()
            comm(output, x.reshape(-1).clone(), dist.group.WORLD, dist.ReduceOp.SUM)
            out[name] = (output, _socket_bytes_written() - before)
        results.append(out)
    return results


def test_the_embeddings_reduce_scatter_sends_touched_rows_and_sums_bit_for_bit(rank_pool):
    for rank, results in enumerate(rank_pool(2).run(_touched_rows_sums)):
        for wire, result in zip(("fp32", "bf16"), results):
            (dense, dense_bytes), (touched, touched_bytes) = result["dense"], result["touched"]
            assert torch.equal(touched.view(torch.int32), dense.view(torch.int32)), f"rank {rank}, {wire}"
            # About a tenth of the rows and their indices (+ three calls' headers), not all of them.
            assert touched_bytes < dense_bytes / 4, (rank, wire, touched_bytes, dense_bytes)


def _fp32_sum_of_bf16_chunks(inputs: list[torch.Tensor], me: int) -> torch.Tensor:
    """By hand: chunk `me` of every rank's input rounded to bf16, summed in fp32 in rank order."""
    chunks = [x.view(len(inputs), -1)[me].to(torch.bfloat16).float() for x in inputs]
    total = chunks[0].clone()
    for chunk in chunks[1:]:
        total += chunk
    return total


def _bf16_wire_sums() -> list[dict]:
    """For each of SIZES: the bf16-wire reduce-scatter (blocking and overlapped), the hand-made
    reference, gloo's own bf16 sum, and the bytes this process wrote for the fp32 and bf16 ones."""
    init_gloo()
    n, me, results = dist.get_world_size(), dist.get_rank(), []
    for numel in SIZES:
        x = _inputs(numel)
        outs = {}
        for name in ("fp32", "bf16", "overlapped"):
            comm = AllToAllReduceScatter(None if name == "fp32" else torch.bfloat16)
            comm.overlapping = name == "overlapped"
            outs[name] = torch.empty(numel // n)
            before = _socket_bytes_written()
            comm(outs[name], x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
            comm.finish()
            outs[f"{name}_written"] = _socket_bytes_written() - before
        gloo_bf16 = x.to(torch.bfloat16)
        dist.all_reduce(gloo_bf16)
        results.append({**outs, "by_hand": _fp32_sum_of_bf16_chunks([_inputs(numel, r) for r in range(n)], me),
                        "gloo_bf16": gloo_bf16.view(n, -1)[me].float(), "input_bytes": x.numel() * 4})
    return results


@pytest.fixture(scope="module")
def bf16_wire_sums(rank_pool) -> list[list[dict]]:
    return rank_pool(2).run(_bf16_wire_sums)


def test_bf16_wire_sums_the_bf16_chunks_in_fp32_bit_for_bit(bf16_wire_sums):
    for rank, results in enumerate(bf16_wire_sums):
        for numel, r in zip(SIZES, results):
            where = f"rank {rank}, {numel} elements"
            assert r["bf16"].dtype == torch.float32
            assert torch.equal(r["bf16"], r["by_hand"]), where
            assert torch.equal(r["overlapped"], r["by_hand"]), where
        # The rounding happened, and the sum is not a bf16 one: both differ somewhere.
        big = results[-1]
        assert not torch.equal(big["bf16"], big["fp32"])
        assert not torch.equal(big["bf16"], big["gloo_bf16"])


def test_bf16_wire_writes_half_the_fp32_bytes(bf16_wire_sums):
    for results in bf16_wire_sums:
        r = results[-1]  # 1 MiB of fp32 input: the headers are noise
        sent = r["input_bytes"] / 2  # (n-1)/n of it in fp32 on two ranks
        assert sent <= r["fp32_written"] <= sent * 1.02 + 1024, r["fp32_written"]
        assert sent / 2 <= r["bf16_written"] <= sent / 2 * 1.02 + 1024, r["bf16_written"]


def test_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match="sums only"):
        AllToAllReduceScatter()(torch.empty(1), torch.empty(2), None, dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="synchronously"):
        AllToAllReduceScatter()(torch.empty(1), torch.empty(2), None, dist.ReduceOp.SUM, async_op=True)


# ------------------------------------------------------------------- a real FSDP backward

def _socket_bytes_written() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise KeyError("wchar")


class Measured(ReduceScatter):
    """`inner`, recording (input bytes, bytes this process wrote while it ran) per call."""

    def __init__(self, inner: ReduceScatter, calls: list, tensors: list | None = None):
        self.inner, self.calls, self.tensors = inner, calls, tensors

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        before = _socket_bytes_written()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((input_tensor.numel() * input_tensor.element_size(), _socket_bytes_written() - before))
        if self.tensors is not None:  # the input as sent, the output the sum lands in (later, if overlapped)
            self.tensors.append((input_tensor.clone(), output_tensor))
        return work


def _unit_groups(model):
    return [group for m in model.modules() if isinstance(m, FSDPModule) for group in m._get_fsdp_state()._fsdp_param_groups]


def _fsdp_backward() -> dict:
    """One forward/backward of the tiny model under FSDP over both ranks, with gloo's
    reduce-scatter and with the all-to-all one: their gradients, bytes, and the planner's log."""
    model, ids = tiny_fsdp_model()
    installed = {module: module._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
                 for module in model.modules() if isinstance(module, FSDPModule)}
    result = {"installed": {type(group._reduce_scatter_comm) for group in _unit_groups(model)},
              "embedding's": type(installed[model.embed]),
              "root_bytes": 4 * sum(p.numel() for name, p in model.named_parameters()
                                    if name.startswith(("norm.", "lm_head.")))}
    for name, comm in (("gloo", DefaultReduceScatter), ("all_to_all", AllToAllReduceScatter),
                       ("overlapped", AllToAllReduceScatter), ("as trained", lambda: installed[model])):
        calls: list = []
        shared = comm()  # one object for every unit (the embedding's own as trained), as install_gloo_communication installs it
        if name in ("overlapped", "as trained"):
            shared.overlapping = True
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(Measured(installed[module] if name == "as trained" and
                                                          module is model.embed else shared, calls))
        model.zero_grad(set_to_none=True)
        log = CollectiveLog()
        with log:
            model(ids, labels=ids).ce_sum.backward()
        result[name] = {"in_flight_after_backward": len(getattr(shared, "_pending", []))}
        if getattr(shared, "overlapping", False):
            shared.finish()
            shared.overlapping = False
        result[name].update(grads={n: p.grad.to_local().clone() for n, p in model.named_parameters()},
                            calls=calls, logged=sent_by_category(log.calls))
    return result


@pytest.fixture(scope="module")
def fsdp_backward(rank_pool) -> list[dict]:
    return rank_pool(2).run(_fsdp_backward)


def test_every_unit_of_a_cpu_job_takes_the_all_to_all(fsdp_backward):
    for result in fsdp_backward:
        assert result["installed"] == {AllToAllReduceScatter, TouchedRowsReduceScatter}
        assert result["embedding's"] is TouchedRowsReduceScatter


def test_fsdp_gradients_are_bitwise_gloos(fsdp_backward):
    for rank, result in enumerate(fsdp_backward):
        theirs, ours = result["gloo"]["grads"], result["all_to_all"]["grads"]
        assert theirs.keys() == ours.keys()
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), f"rank {rank}: {name}"


def test_overlapped_reduce_scatters_travel_past_the_backward_and_give_the_same_bits(fsdp_backward):
    """`overlapping`: each unit's all-to-all is left in flight while the next unit's backward
    runs; the last one is still travelling when backward() returns, and `finish()` lands the
    same sums bit for bit."""
    for rank, result in enumerate(fsdp_backward):
        assert result["overlapped"]["in_flight_after_backward"] == AllToAllReduceScatter.IN_FLIGHT
        assert result["all_to_all"]["in_flight_after_backward"] == 0
        theirs, ours = result["all_to_all"]["grads"], result["overlapped"]["grads"]
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), f"rank {rank}: {name}"


def test_the_roots_reduce_scatter_leaves_first_in_an_overlapped_backward(fsdp_backward):
    """The root unit (final norm, head) has its gradients near the backward's start: with the
    objects `install_gloo_communication` installs (overlapping; the embedding's sends its touched rows), its
    reduce-scatter is the first one issued (FSDP's own order puts it in the final callback, after
    every block's) and the sums are gloo's, bit for bit."""
    for rank, result in enumerate(fsdp_backward):
        ours = [size for size, _ in result["as trained"]["calls"]]
        plain = [size for size, _ in result["overlapped"]["calls"]]
        assert sorted(ours) == sorted(plain) and ours.count(result["root_bytes"]) == 1
        assert ours[0] == result["root_bytes"] != plain[0]
        theirs, mine = result["all_to_all"]["grads"], result["as trained"]["grads"]
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), f"rank {rank}: {name}"


def test_each_reduce_scatter_writes_half_the_bytes(fsdp_backward):
    for result in fsdp_backward:
        before, after = result["gloo"]["calls"], result["all_to_all"]["calls"]
        assert len(before) == len(after) > 0
        assert [size for size, _ in before] == [size for size, _ in after]
        for size, written in before:  # an all-reduce's ring: 2 (n-1)/n of the tensor, headers aside
            assert size <= written <= size * 1.02 + 1024, (size, written)
        for size, written in after:  # (n-1)/n
            assert size / 2 <= written <= size / 2 * 1.02 + 1024, (size, written)
        total = sum(size for size, _ in after)
        # The planner's log credits both with the textbook (n-1)/n, under FSDP reduce-scatter (the
        # embedding's forward gathers its rows: parallel/gloo/embedding_all_gather.py).
        for name in ("gloo", "all_to_all"):
            logged = result[name]["logged"]
            assert logged[FSDP_REDUCE_SCATTER] == total / 2
            assert set(logged) == {FSDP_ALL_GATHER, FSDP_EMBEDDING_ROWS_GATHER, FSDP_REDUCE_SCATTER}, logged


# ------------------------------------------------------------------- bf16 on the wire, in FSDP

def _fsdp_backward_bf16_wire() -> dict:
    """`_fsdp_backward`'s model and batch built with `parallel.reduce_wire_dtype = "bf16"`, its
    reduce-scatters overlapped as in training: the gradients, bytes, log, and each call's output
    against the hand-made fp32 sum of every rank's bf16-rounded chunk."""
    model, ids = tiny_fsdp_model(reduce_wire_dtype="bf16")
    groups = _unit_groups(model)
    shared = groups[0]._reduce_scatter_comm
    result = {"installed": {(type(g._reduce_scatter_comm), g._reduce_scatter_comm.wire_dtype) for g in groups},
              "reduce_dtypes": {g.mp_policy.reduce_dtype for g in groups}}
    # Overlapped (as in training) for the sums; then blocking, so that each call's bytes are
    # written before it returns.
    calls, tensors = [], []
    for overlapping in (True, False):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(Measured(shared, calls if not overlapping else [],
                                                          tensors if overlapping else None))
        shared.overlapping = overlapping
        model.zero_grad(set_to_none=True)
        log = CollectiveLog()
        with log:
            model(ids, labels=ids).ce_sum.backward()
        shared.finish()
        if overlapping:
            grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    n, me = dist.get_world_size(), dist.get_rank()
    unequal = []
    for i, (sent, output) in enumerate(tensors):
        inputs = [torch.empty_like(sent) for _ in range(n)]
        dist.all_gather(inputs, sent)
        if not torch.equal(output, _fp32_sum_of_bf16_chunks(inputs, me)):
            unequal.append(i)
    result.update(grads=grads, calls=calls, logged=sent_by_category(log.calls), unequal=unequal,
                  output_dtypes={output.dtype for _, output in tensors})
    return result


@pytest.fixture(scope="module")
def fsdp_backward_bf16_wire(rank_pool) -> list[dict]:
    return rank_pool(2).run(_fsdp_backward_bf16_wire)


def test_bf16_wire_is_installed_on_every_unit_with_an_fp32_policy(fsdp_backward_bf16_wire):
    for result in fsdp_backward_bf16_wire:
        assert result["installed"] == {(AllToAllReduceScatter, torch.bfloat16), (TouchedRowsReduceScatter, torch.bfloat16)}
        assert result["reduce_dtypes"] == {None}  # FSDP hands fp32 gradients over; the comm casts
        assert result["output_dtypes"] == {torch.float32}


def test_bf16_wire_fsdp_gradients_are_the_fp32_sums_of_bf16_shards(fsdp_backward_bf16_wire, fsdp_backward):
    for rank, (result, fp32) in enumerate(zip(fsdp_backward_bf16_wire, fsdp_backward)):
        assert result["calls"] and result["unequal"] == [], f"rank {rank}: calls {result['unequal']} differ"
        # Against fp32 on the wire: one bf16 rounding apart (2^-8 of each term), never equal.
        theirs, ours = fp32["all_to_all"]["grads"], result["grads"]
        assert theirs.keys() == ours.keys()
        for name in theirs:
            assert (ours[name] - theirs[name]).norm() <= 2**-8 * theirs[name].norm() + 1e-12, f"rank {rank}: {name}"
        assert any(not torch.equal(ours[name], theirs[name]) for name in theirs)


def test_bf16_wire_fsdp_reduce_scatter_writes_a_quarter_of_the_fp32_input(fsdp_backward_bf16_wire):
    for result in fsdp_backward_bf16_wire:
        for size, written in result["calls"]:  # fp32 input: (n-1)/n of it, as bf16
            assert size / 4 <= written <= size / 4 * 1.02 + 1024, (size, written)
        total = sum(size for size, _ in result["calls"])
        assert result["logged"][FSDP_REDUCE_SCATTER] == total / 4


def _hsdp_backward() -> dict:
    """HSDP over the two ranks (two replicas of one shard each), one backward with fp32 and with
    bf16 gradients on the wire, and this rank's own gradients from one process on its batch."""
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.parallel.gloo.communication import install_gloo_communication
    from trinity_train.parallel.parallelize import build_parallel_model

    init_gloo()
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (2, 16), generator=g)
    result = {}
    for wire in ("fp32", "bf16", "one process"):
        parallel = {"dp_replicate": 2, "dp_shard": 1, "reduce_wire_dtype": "bf16" if wire == "bf16" else "full"}
        cfg = load_config(None, {"model": dict(TINY_MODEL), "parallel": parallel})
        dims = ParallelDims.one_process() if wire == "one process" else ParallelDims.from_config(cfg, 2)
        if dims.is_distributed:
            dims.build_mesh("cpu")
        model = build_parallel_model(cfg, dims, torch.device("cpu"))
        install_gloo_communication(model, None, dims, torch.device("cpu"), cfg.parallel.reduce_wire_dtype)
        log = CollectiveLog()
        with log:
            model(ids, labels=ids).ce_sum.backward()
        local = {name: p.grad.to_local() if dims.is_distributed else p.grad for name, p in model.named_parameters()}
        result[wire] = {"grads": {name: grad.clone() for name, grad in local.items()},
                        "logged": sent_by_category(log.calls),
                        "reduce_dtypes": {g.mp_policy.reduce_dtype for g in _unit_groups(model)}}
    own = result["one process"]["grads"]
    theirs = {}
    for name, grad in own.items():  # every rank's own gradients, for the hand-made sums
        both = [torch.empty_like(grad) for _ in range(2)]
        dist.all_gather(both, grad)
        theirs[name] = both
    result["ranks' own"] = theirs
    return result


@pytest.fixture(scope="module")
def hsdp_backward(rank_pool) -> list[dict]:
    return rank_pool(2).run(_hsdp_backward)


@pytest.mark.slow  # three models built and run on both ranks
def test_hsdp_all_reduce_sends_bf16_and_sums_in_bf16(hsdp_backward):
    """Under HSDP FSDP's own all-reduce carries the bf16 gradients (its policy casts them): half
    the bytes, and gloo sums the two replicas' bf16 gradients in bf16."""
    for rank, result in enumerate(hsdp_backward):
        fp32, bf16 = result["fp32"], result["bf16"]
        assert bf16["reduce_dtypes"] == {torch.bfloat16} and fp32["reduce_dtypes"] == {None}
        assert bf16["logged"][FSDP_ALL_REDUCE] == fp32["logged"][FSDP_ALL_REDUCE] / 2 > 0
        for name, (g0, g1) in result["ranks' own"].items():
            # One process's gradients equal fp32 HSDP's sum of them (two terms: either order)...
            assert torch.equal(fp32["grads"][name], g0 + g1), f"rank {rank}: {name}"
            # ...and bf16 on the wire is their bf16 roundings summed and rounded to bf16.
            by_hand = (g0.to(torch.bfloat16).float() + g1.to(torch.bfloat16).float()).to(torch.bfloat16).float()
            assert torch.equal(bf16["grads"][name], by_hand), f"rank {rank}: {name}"
