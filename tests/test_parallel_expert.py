"""Expert parallelism (all-to-all dispatch/combine, expert width over tp) against one process.

One 4-rank gloo group checks several layouts of the model's own `GroupedExperts`: every rank's
outputs, input gradients and the summed expert-weight gradients must equal what the unsplit
module computes for the same tokens. Token counts are uneven and some experts get no tokens.

With bf16 on the wire (`ExpertParallel(torch.bfloat16)`, `parallel.ep_wire_dtype = "bf16"`) every
token and every gradient that crosses between ranks is rounded to bf16 once: the results equal
the unsplit module's run by hand on bf16-rounded inputs, output gradients, and rounded outputs
and input gradients (without tp, whose partial sums travel rounded each); every all-to-all of activations or their gradients sends bf16, half the
bytes of fp32, and the results stay within bf16 rounding of the fp32 path.

A whole MoE layer over ep = 4 computes its shared expert while the dispatch's all-to-all travels,
forward and backward (the order of issue, compute and wait, recorded at torch's dispatcher), with
outputs and gradients bit for bit those of the shared expert computed after the routed ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from torch.utils._python_dispatch import TorchDispatchMode

from unittest import mock

from trinity_harness.ranks import init_gloo
from trinity_train.config import ModelConfig
from trinity_train.model.moe import MoE, GroupedExperts
from trinity_train.parallel.expert_parallel import ExpertParallel, cut_runs, through_experts

E, D, I = 8, 16, 16
LAYOUTS = {  # name: (efsdp, ep, tp) over 4 ranks
    "ep2": (2, 2, 1),
    "ep4": (1, 4, 1),
    "tp2": (2, 1, 2),
    "ep2_tp2": (1, 2, 2),
}
BF16_LAYOUTS = ["ep2", "ep4", "ep2_tp2"]  # the layouts with an ep all-to-all
WAVES = {"ep2": 3, "ep4": 2, "ep2_tp2": 2}  # waves of local experts: 4 in 3 runs (1+1+2), 2 in 2


def _tokens(data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token copies sorted by expert, as MoE.forward makes them; every data rank differs."""
    g = torch.Generator().manual_seed(100 + data_rank)
    n = 5 + 7 * data_rank
    experts = torch.randint(0, E, (n,), generator=g)
    experts[experts == data_rank % E] = (data_rank + 3) % E  # this rank sends nothing to one expert
    experts = experts.sort().values
    return torch.randn(n, D, generator=g), torch.bincount(experts, minlength=E)


def _full_experts(impl: str) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, I, "silu", impl)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return experts


class AllToAllDtypes(TorchDispatchMode):
    """The dtype of every all-to-all's input (forward and backward), with its element count."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in ("all_to_all_single", "alltoall_base_"):
            tensor = args[0] if func._schema.name.endswith("all_to_all_single") else args[1]
            self.sent.append((tensor.dtype, tensor.numel()))
        return func(*args, **(kwargs or {}))


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _check_layout(shape: tuple[int, int, int], impl: str, wire_dtype: torch.dtype | None = None,
                  waves: int = 1) -> dict:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("efsdp", "ep", "tp"))
    data_rank = mesh["efsdp", "ep"]._flatten().get_local_rank()
    x, counts = _tokens(data_rank)
    proj = torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(7 + data_rank))
    # bf16 on the wire, by hand: the experts see bf16-rounded tokens and output gradients, and
    # the combine and the dispatch's backward return bf16-rounded outputs and input gradients.
    wire = _bf16 if wire_dtype is not None and shape[1] > 1 else (lambda t: t)

    ref = _full_experts(impl)
    x_ref = wire(x).clone().requires_grad_()
    out_ref = ref(x_ref, counts)
    (out_ref * wire(proj)).sum().backward()
    out_ref, x_ref_grad = wire(out_ref.detach()), wire(x_ref.grad)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for g in ref_grads.values():  # the experts see the tokens of every rank of the ep group
        dist.all_reduce(g, group=mesh["ep"].get_group())

    par = parallelize_module(_full_experts(impl), mesh["ep", "tp"], ExpertParallel(wire_dtype, waves))
    x_par = x.clone().requires_grad_()
    sent = AllToAllDtypes()
    with sent:
        out = par(x_par, counts)
        (out * proj).sum().backward()
    errors = {"out": (out - out_ref).abs().max().item(),
              "x_grad": (x_par.grad - x_ref_grad).abs().max().item()}
    for n, p in par.named_parameters():
        assert isinstance(p, DTensor) and p.shape == ref_grads[n].shape
        errors[n] = (p.grad.full_tensor() - ref_grads[n]).abs().max().item()
    local_experts = par.gate_proj.to_local().shape[0]
    return {"errors": errors, "local_experts": local_experts, "sent": sent.sent,
            "out": out.detach(), "x_grad": x_par.grad,
            "grads": {n: p.grad.full_tensor() for n, p in par.named_parameters()}}


def _dispatch_roundtrip(waves: int) -> list:
    """The experts' side sees its rows grouped by local expert, and what it returns comes back to
    the rows it came from (ep=4, one rank sending nothing; the experts add 0.5 to every row)."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    counts = torch.tensor([[2, 0, 1, 3, 0, 0, 4, 1], [0, 0, 0, 0, 0, 0, 0, 0],
                           [1, 1, 1, 1, 1, 1, 1, 1], [0, 5, 0, 0, 2, 0, 0, 0]])[rank]
    x = torch.arange(int(counts.sum()) * 2, dtype=torch.float32).view(-1, 2) + 1000 * rank
    seen: list[tuple[list[int], list[list[float]]]] = []

    def compute(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        seen.append((local_counts.tolist(), rows.tolist()))
        return rows + 0.5

    back = through_experts(x, counts, group, compute, waves=waves)
    return [seen, (back - x - 0.5).abs().max().item() if x.numel() else 0.0]


class Timeline(TorchDispatchMode):
    """In dispatch order: all-to-alls issued, tensors waited on, and ops that read `weights`."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = {w.data_ptr() for w in weights}  # a transposed view starts where its weight does
        self.events: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name == "wait_tensor":
            self.events.append(("wait", args[0].data_ptr()))
        out = func(*args, **(kwargs or {}))
        if name == "all_to_all_single":
            self.events.append(("issue", out.data_ptr()))
        elif any(type(a) is torch.Tensor and a.data_ptr() in self.weights for a in args):
            self.events.append(("shared", 0))
        return out

    def hidden(self, events: list[tuple[str, int]]) -> int:
        """How many of `events`' shared-expert ops ran between an all-to-all's issue and its
        recorded wait (a wait made inside a subclass's dispatch, the first use of funcol's
        AsyncCollectiveTensor, is below this mode and unseen: that issue counts for nothing)."""
        spans = []
        for i, (kind, ptr) in enumerate(events):
            if kind == "issue":
                wait = next((j for j in range(i + 1, len(events)) if events[j] == ("wait", ptr)), None)
                if wait is not None:
                    spans.append((i, wait))
        return sum(1 for i, (kind, _) in enumerate(events)
                   if kind == "shared" and any(start < i < end for start, end in spans))


def _moe_layer_run(overlapped: bool, waves: int = 1) -> dict:
    """One MoE layer (shared expert, aux and z losses) over ep = all ranks, forward and backward;
    not `overlapped`: the shared expert after the routed ones, as a compiled block runs it. In
    "hidden": how many shared-expert ops and how many routed-expert ops ran while an all-to-all
    travelled (forward, backward)."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                      aux_loss_alpha=1e-2, z_loss_weight=1e-3)
    moe = MoE(cfg, "silu", mid_norm_eps=1e-5)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    parallelize_module(moe.experts, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)),
                       ExpertParallel(waves=waves))
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(dist.get_rank())).requires_grad_()
    shared = Timeline([p for n, p in moe.shared_expert.named_parameters() if n.endswith("proj.weight")])
    routed = Timeline([p.to_local() for p in moe.experts.parameters()])
    with shared, routed, mock.patch("torch.compiler.is_compiling", return_value=not overlapped):
        out, aux = moe(x)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + aux.aux_loss + aux.router_z.sum()
        forward = len(shared.events), len(routed.events)
        loss.backward()
    hidden = {what: (timeline.hidden(timeline.events[:n]), timeline.hidden(timeline.events[n:]))
              for what, timeline, n in (("shared", shared, forward[0]), ("routed", routed, forward[1]))}
    return {"out": out.detach(), "x_grad": x.grad,
            **{n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in moe.named_parameters()},
            "hidden": hidden}


def _fsdp_view_warnings() -> list[str]:
    """The tiny model under TP 2 x EP 2 with FSDP (its experts their own unit), one forward and
    backward: FSDP2's warnings that a unit returned a view (an in-place op on it would drop the
    unit's pre-backward hook), and a check that the step ran."""
    import warnings

    from conftest import TINY_MODEL
    from trinity_train.config import load_config
    from trinity_train.parallel.mesh import ParallelDims
    from trinity_train.parallel.parallelize import build_parallel_model

    cfg = load_config(None, {"model": dict(TINY_MODEL), "parallel": {"tp": 2, "ep": 2}})
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_parallel_model(cfg, dims, torch.device("cpu"))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(dims.dp_rank))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(ids, labels=ids).ce_sum.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return [str(w.message) for w in seen if "returned a view" in str(w.message)]


def _all_checks() -> dict:
    """Everything this file checks, in one spawned group (starting ranks is the slow part)."""
    init_gloo()
    results = {(name, impl): _check_layout(shape, impl)
               for name, shape in LAYOUTS.items() for impl in ("grouped", "loop")}
    results.update({(name, "bf16 wire"): _check_layout(LAYOUTS[name], "grouped", torch.bfloat16)
                    for name in BF16_LAYOUTS})
    results.update({(name, impl, "waves"): _check_layout(LAYOUTS[name], impl, waves=WAVES[name])
                    for name in WAVES for impl in ("grouped", "loop")})
    results["roundtrip"] = {waves: _dispatch_roundtrip(waves) for waves in (1, 2)}
    results["moe layer"] = {(overlapped, waves): _moe_layer_run(overlapped, waves)
                            for overlapped, waves in ((True, 1), (False, 1), (True, 2))}
    results["fsdp view warnings"] = _fsdp_view_warnings()
    return results


@pytest.fixture(scope="module")
def rank_results(rank_pool):
    return rank_pool(4).run(_all_checks)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_matches_single_process(rank_results, layout, impl):
    for rank, results in enumerate(rank_results):
        res = results[(layout, impl)]
        for what, err in res["errors"].items():
            assert err < 1e-5, f"rank {rank} {layout}/{impl}: {what} differs by {err}"
        _, ep, _ = LAYOUTS[layout]
        assert res["local_experts"] == E // ep


@pytest.mark.parametrize("layout", ["ep2", "ep4"])  # under tp each tp rank's partial sums travel, each rounded
def test_bf16_wire_is_the_unsplit_module_on_bf16_rounded_traffic(rank_results, layout):
    for rank, results in enumerate(rank_results):
        for what, err in results[(layout, "bf16 wire")]["errors"].items():
            assert err < 1e-5, f"rank {rank} {layout}: {what} differs by {err}"


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_wire_stays_within_bf16_rounding_of_fp32(rank_results, layout):
    for rank, results in enumerate(rank_results):
        fp32, bf16 = results[(layout, "grouped")], results[(layout, "bf16 wire")]
        for what in ("out", "x_grad"):
            diff = (bf16[what] - fp32[what]).norm()
            assert 0 < diff <= 2**-7 * fp32[what].norm(), f"rank {rank} {layout}: {what} off by {diff}"


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_wire_sends_every_token_and_gradient_in_bf16(rank_results, layout):
    """The dispatch and the combine, forward and backward: four all-to-alls of bf16 rows, as
    many elements as the fp32 path's four, so half the bytes; the counts' exchange stays exact."""
    for rank, results in enumerate(rank_results):
        fp32, bf16 = results[(layout, "grouped")]["sent"], results[(layout, "bf16 wire")]["sent"]
        assert [dtype for dtype, _ in fp32] == [torch.int64] + [torch.float32] * 4, fp32
        assert [dtype for dtype, _ in bf16] == [torch.int64] + [torch.bfloat16] * 4, bf16
        assert [numel for _, numel in bf16] == [numel for _, numel in fp32]


def test_dispatch_groups_tokens_by_local_expert_and_combine_restores_them(rank_results):
    # rank 0 owns experts 0 and 1: it receives expert 0's rows (from ranks 0 then 2), then expert 1's
    # (from ranks 2 then 3); rank 1 sends nothing.
    (local_counts, local_rows), = rank_results[0]["roundtrip"][1][0]
    assert local_counts == [3, 6]
    firsts = [row[0] for row in local_rows]
    assert firsts == [0.0, 2.0, 2000.0, 2002.0, 3000.0, 3002.0, 3004.0, 3006.0, 3008.0]
    for rank, results in enumerate(rank_results):
        for waves, (_, roundtrip_err) in results["roundtrip"].items():
            assert roundtrip_err == 0.0, f"rank {rank}, {waves} waves: combine did not undo dispatch"


def test_waves_carry_one_run_of_local_experts_each(rank_results):
    """In two waves rank 0's first wave holds expert 0's rows only, the second expert 1's: the
    same rows, in the same order, as one wave gives each expert."""
    assert cut_runs(4, 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert cut_runs(2, 4) == [range(0, 1), range(1, 2)]  # no more waves than local experts
    (_, one_wave), = rank_results[0]["roundtrip"][1][0]
    (counts0, rows0), (counts1, rows1) = rank_results[0]["roundtrip"][2][0]
    assert (counts0, counts1) == ([3, 0], [0, 6])
    assert rows0 + rows1 == one_wave


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Bit for bit, or (not `exact`) within the tolerance the layouts keep to one process."""
    return torch.equal(a, b) if exact else (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("layout", list(WAVES))
def test_waves_give_the_numbers_of_one_wave(rank_results, layout, impl):
    """Every expert computes the same rows in the same order: bit for bit with the per-expert
    loop. The grouped GEMM applies the activation to the whole buffer, where CPU vector kernels
    round an element 1 ulp differently when it falls in a loop's scalar tail, which depends on its
    position (as EP's buffers differ from one process's): within the layouts' tolerance there."""
    exact = impl == "loop"
    for rank, results in enumerate(rank_results):
        one, waved = results[(layout, impl)], results[(layout, impl, "waves")]
        for what in ("out", "x_grad"):
            assert _same(one[what], waved[what], exact), f"rank {rank} {layout}/{impl}: {what} differs"
        for name, grad in one["grads"].items():
            assert _same(grad, waved["grads"][name], exact), f"rank {rank} {layout}/{impl}: {name} differs"
        # a dispatch and a combine per wave, forward and backward, after the one count exchange
        assert len(waved["sent"]) == 1 + 4 * WAVES[layout], waved["sent"]


def test_shared_expert_computes_while_the_dispatch_travels_with_the_same_numbers(rank_results):
    for rank, results in enumerate(rank_results):
        overlapped, after = results["moe layer"][(True, 1)], results["moe layer"][(False, 1)]
        # gate, up and down each read their weight while the all-to-all travels, forward (one
        # matmul each) and backward (the input gradients' matmuls)
        forward, backward = overlapped["hidden"]["shared"]
        assert forward == 3 and backward >= 3, f"rank {rank}: {overlapped['hidden']}"
        assert after["hidden"]["shared"] == (0, 0), f"rank {rank}: {after['hidden']}"
        for what, value in after.items():
            if what != "hidden":
                assert torch.equal(overlapped[what], value), f"rank {rank}: {what} differs"


def test_in_waves_the_experts_compute_while_tokens_travel(rank_results):
    for rank, results in enumerate(rank_results):
        one, two = results["moe layer"][(True, 1)], results["moe layer"][(True, 2)]
        # one wave: the experts' ops run with nothing in flight; two: the first wave's while the
        # second's tokens travel, the second's while the first's results travel back, and the
        # same in the backward
        assert one["hidden"]["routed"] == (0, 0), f"rank {rank}: {one['hidden']}"
        forward, backward = two["hidden"]["routed"]
        assert forward > 0 and backward > 0, f"rank {rank}: {two['hidden']}"
        assert two["hidden"]["shared"] == one["hidden"]["shared"], f"rank {rank}: {two['hidden']}"
        for what, value in one.items():
            if what != "hidden":  # the grouped GEMM: see test_waves_give_the_numbers_of_one_wave
                assert _same(two[what], value, exact=False), f"rank {rank}: {what} differs"


def test_the_experts_unit_under_tp_and_ep_returns_no_view(rank_results):
    # DTensor's full_tensor() returns a view; the TP output's all-reduce returns a tensor of its own.
    for rank, result in enumerate(rank_results):
        assert result["fsdp view warnings"] == [], f"rank {rank}: {result['fsdp view warnings'][:1]}"
