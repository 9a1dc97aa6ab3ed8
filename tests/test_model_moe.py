"""The MoE layer: routing and the expert bias, grouped GEMM vs loop, the dispatch seam, the
load-balancing rules and the optional router losses."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from trinity_train.config import ModelConfig
from trinity_train.model import build_model
from trinity_train.model.moe import GroupedExperts, MoE, Router, update_expert_bias

E, K, D, I = 6, 2, 16, 8


def moe_config(**overrides) -> ModelConfig:
    return tiny_model(**{"vocab_size": 32, "hidden_size": D, "num_layers": 3, "num_heads": 2,
                         "num_kv_heads": 1, "intermediate_size": 24, "num_experts": E,
                         "num_experts_per_tok": K, "moe_intermediate_size": I, "route_scale": 2.0,
                         **overrides})


def drawn(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return module


def test_expert_bias_changes_selection_but_not_routing_weights():
    router = drawn(Router(D, E, K, route_scale=2.0))
    x = torch.randn(20, D)
    plain = router(x, torch.zeros(E))
    forced = router(x, torch.tensor([0.0, 0, 0, 0, 10.0, 10.0]))  # experts 4 and 5 always win
    assert not torch.equal(plain.experts.sort(-1).values, forced.experts.sort(-1).values)
    assert torch.equal(forced.experts.sort(-1).values, torch.tensor([[4, 5]]).expand(20, 2))
    # Weights are the unbiased sigmoid scores of the chosen experts, normalised, times route_scale.
    scores = torch.sigmoid(x @ router.gate.weight.T)
    chosen = scores.gather(-1, forced.experts)
    torch.testing.assert_close(forced.weights, 2.0 * chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(forced.weights.sum(-1), torch.full((20,), 2.0))
    torch.testing.assert_close(plain.scores, forced.scores)


@pytest.mark.parametrize("fp32", [True, False])
def test_router_logits_under_bf16_autocast(fp32):
    router = drawn(Router(D, E, K, route_scale=2.0, fp32=fp32))
    x = torch.randn(20, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x, torch.zeros(E))
    routing.weights.sum().backward()
    exact = x.detach() @ router.gate.weight.detach().T
    assert routing.logits.dtype == torch.float32
    if fp32:  # the fp32 GEMM, untouched by autocast, and gradients that flow in fp32
        torch.testing.assert_close(routing.logits, exact)
        assert x.grad.dtype == router.gate.weight.grad.dtype == torch.float32
    else:  # autocast ran the gate in bf16: the logits carry its rounding
        assert not torch.allclose(routing.logits, exact, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(routing.logits, exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_and_loop_agree_in_outputs_and_gradients(dtype):
    grouped = drawn(GroupedExperts(E, D, I, "silu", "grouped"))
    loop = GroupedExperts(E, D, I, "silu", "loop")
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([3, 0, 5, 1, 0, 4])  # includes experts that receive no token
    x = torch.randn(int(counts.sum()), D)
    target = torch.randn(int(counts.sum()), D)
    results = []
    for experts in (grouped, loop):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = experts(xi, counts)
        F.mse_loss(out.float(), target).backward()
        results.append((out, xi.grad, [p.grad for p in experts.parameters()]))
    (out_g, gx_g, gw_g), (out_l, gx_l, gw_l) = results
    assert out_g.dtype == dtype == out_l.dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_g.float(), out_l.float(), **tol)
    torch.testing.assert_close(gx_g, gx_l, **tol)
    for a, b in zip(gw_g, gw_l):
        torch.testing.assert_close(a, b, **tol)
    assert torch.all(gw_g[0][1] == 0) and torch.all(gw_g[0][0] != 0)  # idle expert: zero grad


def test_grouped_gemm_accepts_broadcast_gradients_and_empty_batches():
    experts = drawn(GroupedExperts(E, D, I, "silu", "grouped"))
    counts = torch.tensor([2, 1, 0, 0, 0, 1])
    experts(torch.randn(4, D), counts).sum().backward()  # sum() sends a zero-stride gradient
    assert experts.down_proj.grad is not None
    experts.zero_grad()
    out = experts(torch.randn(0, D, requires_grad=True), torch.zeros(E, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, D) and torch.all(experts.gate_proj.grad == 0)


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference: sum over chosen experts of weight * SwiGLU, plus shared expert."""
    flat = x.reshape(-1, D)
    routing = moe.router(flat, moe.expert_bias)
    ex = moe.experts
    out = []
    for t in range(flat.shape[0]):
        y = moe.shared_expert(flat[t])
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t]):
            h = F.silu(ex.gate_proj[e] @ flat[t]) * (ex.up_proj[e] @ flat[t])
            y = y + w * (ex.down_proj[e] @ h)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_moe_matches_a_token_by_token_reference(impl):
    moe = drawn(MoE(moe_config(expert_impl=impl), "silu"))
    moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = torch.randn(2, 5, D)
    out, aux = moe(x)
    torch.testing.assert_close(out, reference_moe(moe, x), atol=1e-5, rtol=1e-5)
    assert aux.tokens_per_expert.sum().item() == 2 * 5 * K and not aux.tokens_per_expert.requires_grad


def test_experts_receive_token_copies_sorted_by_expert_through_the_seam():
    moe = drawn(MoE(moe_config(), "silu"))
    seen = {}
    inner = moe.experts.forward

    def spy(x_sorted, num_tokens_per_expert, alongside):  # alongside: the shared expert, run once
        seen["x"], seen["counts"] = x_sorted, num_tokens_per_expert
        return inner(x_sorted, num_tokens_per_expert, alongside)

    moe.experts.forward = spy
    x = torch.randn(1, 7, D)
    routing = moe.router(x.view(-1, D), moe.expert_bias)
    moe(x)
    counts = seen["counts"]
    assert counts.dtype == torch.long and counts.shape == (E,)
    assert torch.equal(counts, torch.bincount(routing.experts.flatten(), minlength=E))
    start = 0
    for e, n in enumerate(counts.tolist()):  # each expert's rows are exactly its tokens
        tokens = (routing.experts == e).any(-1).nonzero().flatten()
        expected = x.view(-1, D)[tokens]
        assert torch.equal(seen["x"][start:start + n], expected)
        start += n


def test_sign_rule_matches_its_formula():
    counts = torch.tensor([10.0, 2.0, 6.0, 6.0, 0.0, 12.0])
    bias, momentum = torch.full((E,), 0.5), torch.zeros(E)
    update_expert_bias(bias, momentum, counts, "sign", gamma=1e-3, smebu_lambda=0, smebu_beta=0,
                       smebu_kappa=0)
    db = 1e-3 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(bias, 0.5 + db - db.mean())
    assert torch.all(momentum == 0)
    assert bias[1] > bias[0]  # the under-loaded expert becomes more attractive


def test_smebu_rule_matches_its_formula_over_two_steps():
    lam, beta, kappa = 5e-4, 0.5, 2.0
    steps = [torch.tensor([10.0, 2.0, 6.0, 6.0, 0.0, 12.0]), torch.tensor([1.0, 9.0, 6.0, 6.0, 8.0, 6.0])]
    bias, momentum = torch.zeros(E), torch.zeros(E)
    ref_b, ref_m = torch.zeros(E), torch.zeros(E)
    for n in steps:
        update_expert_bias(bias, momentum, n, "smebu", gamma=1.0, smebu_lambda=lam,
                           smebu_beta=beta, smebu_kappa=kappa)
        v = (n.mean() - n) / n.mean()
        db = lam * torch.tanh(kappa * v)
        db = db - db.mean()
        ref_m = beta * ref_m + (1 - beta) * db
        ref_b = ref_b + ref_m
        torch.testing.assert_close(momentum, ref_m)
        torch.testing.assert_close(bias, ref_b)
    assert not torch.equal(bias, torch.zeros(E))


def test_model_applies_the_configured_rule_to_every_moe_layer_once():
    model = build_model(moe_config(num_layers=4, load_balance="smebu"))
    counts = torch.stack([torch.arange(E, dtype=torch.float32) + i for i in range(3)])
    model.update_expert_biases(counts)
    for moe, n in zip(model.moe_layers, counts):
        b, m = torch.zeros(E), torch.zeros(E)
        update_expert_bias(b, m, n, "smebu", gamma=0, smebu_lambda=5e-4, smebu_beta=0.5,
                           smebu_kappa=2.0)
        torch.testing.assert_close(moe.expert_bias, b)
        torch.testing.assert_close(moe.bias_momentum, m)
    with pytest.raises(ValueError, match=r"shape \(3, 6\)"):
        model.update_expert_biases(torch.zeros(2, E))
    frozen = build_model(moe_config(load_balance="none"))
    frozen.update_expert_biases(torch.ones(2, E) * torch.arange(E))
    assert all(torch.all(moe.expert_bias == 0) for moe in frozen.moe_layers)


def test_sequence_aux_loss_matches_deepseek_v3_formula():
    alpha = 0.01
    moe = drawn(MoE(moe_config(aux_loss_alpha=alpha), "silu"))
    x = torch.randn(3, 5, D)
    _, aux = moe(x)
    routing = moe.router(x.view(-1, D), moe.expert_bias)
    expected = []
    for b in range(3):
        rows = slice(b * 5, (b + 1) * 5)
        chosen = F.one_hot(routing.experts[rows], E).sum(1).float()  # [T, E]
        f = E / (K * 5) * chosen.sum(0)
        s = routing.scores[rows]
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        expected.append(alpha * (f * p).sum())
    torch.testing.assert_close(aux.aux_loss, torch.stack(expected).mean())
    aux.aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    _, off = drawn(MoE(moe_config(), "silu"))(x)
    assert off.aux_loss.item() == 0 and off.router_z is None


def test_router_z_loss_is_the_weighted_mean_over_counted_tokens():
    model = build_model(moe_config(z_loss_weight=0.1, num_layers=4))
    logits = []
    for moe in model.moe_layers:
        moe.router.register_forward_hook(lambda mod, args, routing: logits.append(routing.logits))
    ids = torch.randint(0, 32, (2, 6))
    labels = ids.clone()
    labels[1, 2:] = -100  # 8 counted tokens
    out = model(ids, labels=labels)
    counted = (labels != -100).flatten()
    per_token = sum(torch.logsumexp(l, -1).square() for l in logits)
    assert len(logits) == 3
    torch.testing.assert_close(out.z_loss, 0.1 * per_token[counted].mean())
    out.z_loss.backward()
    assert model.moe_layers[0].router.gate.weight.grad.abs().sum() > 0
