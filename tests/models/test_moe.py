"""MoE layer numerics on one process: dropless output and gradients against a per-token float64 reference, the
routing rules, capacity dropping, the auxiliary losses and the expert bias, each against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models.moe import MoEConfig, MoELayer, route
from mcore_models.moe.dispatch import apply_capacity, capacity
from mcore_models.moe.metrics import moe_metrics, update_expert_biases
from mcore_parallel import Group


def _config(dtype: str = "float32", **moe: object) -> TransformerConfig:
    fields = dict(num_experts=4, ffn_hidden_size=24, router_topk=2)
    fields.update(moe)
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=32, activation="swiglu", normalization="rmsnorm",
                             position_embedding="rope", add_bias_linear=False, vocab_size=64,
                             make_vocab_size_divisible_by=16, params_dtype=dtype, swiglu_backward="torch",
                             moe=MoEConfig(**fields))  # fmt: skip


def _layer(config: TransformerConfig) -> MoELayer:
    model = GPTModel(config).double()
    layer = model.decoder.layers["0"].mlp
    assert isinstance(layer, MoELayer)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time (float64 loops, no permutation)."""
    moe = layer.moe
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.t()
    r = route(logits, moe, layer.router.expert_bias)
    w1, w2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[t])
        for j in range(moe.router_topk):
            e = int(r.indices[t, j])
            gate, up = (w1[e] @ tokens[t]).chunk(2)
            acc = acc + r.probs[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    out = torch.stack(rows)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x).reshape(out.shape)
    return out.view(x.shape)


@pytest.mark.parametrize("moe", [
    dict(),
    dict(router_pre_softmax=True),
    dict(router_score_function="sigmoid", router_topk_scaling_factor=2.5),
    dict(num_experts=8, router_num_groups=4, router_group_topk=2, router_score_function="sigmoid"),
    dict(shared_expert_ffn_hidden_size=20, shared_expert_gate=True),
])  # fmt: skip
def test_dropless_layer_matches_per_token_reference_with_gradients(moe: dict) -> None:
    torch.manual_seed(0)
    layer = _layer(_config(**moe))
    x = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    ref = _reference(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    params = [layer.router.weight, layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight, x]
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_routing_rules_on_constructed_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    # top-k of the logits, then softmax over the two chosen
    r = route(logits, MoEConfig(num_experts=4, router_topk=2))
    assert r.indices.tolist() == [[0, 1], [1, 3]]
    e = math.exp(1.0)
    torch.testing.assert_close(r.probs[0], torch.tensor([e / (e + 1), 1 / (e + 1)], dtype=torch.float64))
    # softmax over all four, then top-k unnormalised
    r = route(logits, MoEConfig(num_experts=4, router_topk=2, router_pre_softmax=True))
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(r.probs, full.gather(1, r.indices))
    # sigmoid, normalised over the chosen, times the scaling factor
    r = route(logits, MoEConfig(num_experts=4, router_topk=2, router_score_function="sigmoid",
                                router_topk_scaling_factor=2.0))  # fmt: skip
    s = torch.sigmoid(logits).gather(1, r.indices)
    torch.testing.assert_close(r.probs, 2.0 * s / s.sum(-1, keepdim=True))
    # the expert bias changes the choice, not the weights
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=torch.float64)
    r = route(logits, MoEConfig(num_experts=4, router_topk=2, router_score_function="sigmoid"), bias)
    assert r.indices[0].tolist() == [2, 0]
    s = torch.sigmoid(logits[0, [2, 0]])
    torch.testing.assert_close(r.probs[0], s / s.sum())
    # group-limited: two groups of two; group scores (top-1 of each) row 0: 2.0 vs 0.0 -> only experts 0 and 1
    r = route(logits, MoEConfig(num_experts=4, router_topk=2, router_num_groups=2, router_group_topk=1))
    assert sorted(r.indices[0].tolist()) == [0, 1]  # group {0, 1} best 2.0 against {2, 3}'s 0.0
    assert sorted(r.indices[1].tolist()) == [0, 1]  # group {0, 1} best 3.0 against {2, 3}'s 2.0


def test_group_limited_routing_picks_the_best_group() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    r = route(logits, MoEConfig(num_experts=4, router_topk=2, router_num_groups=2, router_group_topk=1))
    assert sorted(r.indices[0].tolist()) == [0, 1]  # group {0, 1} has the best expert (3.0)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_the_policys_tokens(policy: str) -> None:
    # six tokens all want expert 0 first; capacity 2 per expert (6 tokens * top-1 / 3 experts * 1.0)
    indices = torch.tensor([[0], [0], [0], [0], [1], [2]])
    probs = torch.tensor([[0.5], [0.9], [0.1], [0.8], [0.7], [0.6]])
    cap = capacity(6, 1, 3, 1.0)
    assert cap == 2
    kept, dropped = apply_capacity(indices, probs, 3, cap, policy)
    keep0 = {1, 3} if policy == "probs" else {0, 1}
    assert {t for t in range(4) if kept[t, 0] == 0} == keep0
    assert int(dropped) == 2
    assert kept[4, 0] == 1 and kept[5, 0] == 2


def test_capacity_layer_output_drops_those_tokens_and_padding_changes_nothing() -> None:
    torch.manual_seed(1)
    layer = _layer(_config(capacity_factor=0.5))
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    out = layer(x)
    # reference: the per-token computation with the dropped choices' weights set to zero
    tokens = x.reshape(-1, 16)
    r = route(tokens @ layer.router.weight.t(), layer.moe)
    cap = capacity(tokens.shape[0], 2, 4, 0.5)
    kept, _ = apply_capacity(r.indices, r.probs, 4, cap, "probs")
    w1, w2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    ref = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            e = int(kept[t, j])
            if e >= 0:
                gate, up = (w1[e] @ tokens[t]).chunk(2)
                ref[t] += r.probs[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-10, atol=1e-12)
    assert int((kept < 0).sum()) > 0
    padded = _layer(_config(capacity_factor=0.5, pad_expert_input_to_capacity=True))
    padded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(padded(x), out, rtol=1e-10, atol=1e-12)


def _router_fixed(layer: MoELayer, logits: torch.Tensor) -> torch.Tensor:
    """Inputs whose router logits are exactly ``logits`` ([T, E], T <= hidden): one-hot rows and W = logits^T."""
    t = logits.shape[0]
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :t] = logits.t()
    return torch.eye(t, 16, dtype=torch.float64)


def test_aux_losses_equal_hand_computation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0], [1.0, 1.5, 0.5, 0.2],
                           [0.3, 0.2, 2.5, 0.1]], dtype=torch.float64)  # fmt: skip
    probs = torch.softmax(logits, -1)
    choice = logits.topk(2, -1).indices
    counts = torch.zeros(4, dtype=torch.float64).scatter_add_(0, choice.reshape(-1), torch.ones(8, dtype=torch.float64))
    coeff, t, k, e = 0.1, 4, 2, 4
    f = counts / (t * k)
    p = probs.mean(0)
    want_aux = coeff * e * float((f * p).sum())
    lse = torch.logsumexp(logits, -1)
    want_z = 0.01 * float((lse**2).mean())
    for kind, want in (("aux_loss", want_aux), ("global_aux_loss", want_aux)):
        layer = _layer(_config(aux_loss_coeff=coeff, z_loss_coeff=0.01, load_balancing_type=kind))
        x = _router_fixed(layer, logits).view(4, 1, 16)  # [s=4, b=1]
        layer(x)
        stats = layer.stats
        assert stats[0].item() == pytest.approx(want, rel=1e-12)
        assert stats[1].item() == pytest.approx(want_z, rel=1e-12)
        assert stats[4:].tolist() == counts.tolist()
    # sequence-level: two sequences of two tokens ([s=2, b=2]: token t = s_index * 2 + b_index)
    layer = _layer(_config(aux_loss_coeff=coeff, load_balancing_type="seq_aux_loss"))
    x = _router_fixed(layer, logits).view(2, 2, 16)
    layer(x)
    want_seq = 0.0
    for b in range(2):
        rows = [b, 2 + b]
        c = torch.zeros(4, dtype=torch.float64).scatter_add_(
            0, choice[rows].reshape(-1), torch.ones(4, dtype=torch.float64)
        )
        want_seq += coeff * e * float(((c / (2 * k)) * probs[rows].mean(0)).sum()) / 2
    assert layer.stats[0].item() == pytest.approx(want_seq, rel=1e-12)


def test_aux_loss_gradient_reaches_the_router_scaled() -> None:
    torch.manual_seed(2)
    layer = _layer(_config(aux_loss_coeff=0.5))
    x = torch.randn(4, 2, 16, dtype=torch.float64)
    layer.aux_loss_scale.fill_(0.25)
    out = layer(x)
    (g_with,) = torch.autograd.grad(out.sum(), [layer.router.weight])
    plain = _layer(_config(aux_loss_coeff=0.0))
    plain.load_state_dict(layer.state_dict())
    out2 = plain(x)
    tokens = x.reshape(-1, 16)
    r = route(tokens @ plain.router.weight.t(), plain.moe)
    counts = torch.zeros(4, dtype=torch.float64).scatter_add_(
        0, r.indices.reshape(-1), torch.ones(16, dtype=torch.float64)
    )
    aux = 0.5 * 4 * ((counts / (8 * 2)) * r.scores.mean(0)).sum()
    (g_want,) = torch.autograd.grad(out2.sum() + 0.25 * aux, [plain.router.weight])
    torch.testing.assert_close(g_with, g_want, rtol=1e-10, atol=1e-12)


def test_expert_bias_moves_towards_equal_load() -> None:
    config = _config(router_enable_expert_bias=True, router_bias_update_rate=0.1, router_score_function="sigmoid")
    model = GPTModel(config).double()
    layer = model.decoder.layers["0"].mlp
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 4, dtype=torch.float64)  # experts 0, 1 get every token
    x = _router_fixed(layer, logits).view(4, 1, 16)
    layer(x)
    other = model.decoder.layers["1"].mlp
    other.bias_counts.zero_()
    update_expert_biases([model], Group.single())
    # counts [4, 4, 0, 0], mean 2: overloaded experts move down by the rate, idle ones up
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, -0.1, 0.1, 0.1])
    assert layer.bias_counts.abs().sum() == 0
    assert "mlp.router.expert_bias" in "".join(model.state_dict())


def test_moe_metrics_report_per_layer_values_and_reset() -> None:
    torch.manual_seed(3)
    model = GPTModel(_config(aux_loss_coeff=0.1))
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, labels=tokens)
    model(tokens, labels=tokens)
    want = model.decoder.layers["1"].mlp.stats[0].item() / 2
    m = moe_metrics([model], 2, 4, Group.single())
    assert m["moe/layer1/aux_loss"] == pytest.approx(want)
    assert m["moe/layer0/load_max"] >= 1.0 >= m["moe/layer0/load_min"]
    assert model.decoder.layers["0"].mlp.stats.abs().sum() == 0


def test_config_problems_are_reported() -> None:
    with pytest.raises(Exception, match="router_topk=5 exceeds moe.num_experts=4"):
        _config(router_topk=5)
    with pytest.raises(Exception, match="add_bias_linear"):
        TransformerConfig(add_bias_linear=True, moe=MoEConfig())
    with pytest.raises(Exception, match="layer_freq"):
        _config(layer_freq=[1, 0, 1])
    with pytest.raises(Exception, match="unknown moe field"):
        TransformerConfig(add_bias_linear=False, moe={"experts": 4})


def test_layer_freq_places_moe_layers() -> None:
    model = GPTModel(_config(layer_freq=[0, 1]))
    assert not isinstance(model.decoder.layers["0"].mlp, MoELayer)
    assert isinstance(model.decoder.layers["1"].mlp, MoELayer)
