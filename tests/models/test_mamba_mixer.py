"""The Mamba-2 mixer (``mcore_models.ssm.Mamba2Mixer``) computes the published equations (an independent float64
re-implementation here, and Hugging Face's ``Mamba2Mixer`` with the same weights), is causal, initialises as the
published models do, and trains under tensor (and sequence) parallelism exactly like one process."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_models import ConfigError, GPTModel, LayerSpec, MambaConfig, MambaLayer, ModelContext, TransformerConfig
from mcore_models.ssm import Mamba2Mixer
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed

MAMBA: dict[str, Any] = dict(
    d_state=8, head_dim=8, n_groups=2, chunk_size=5
)  # hidden 32: d_inner 64, 8 heads, 2 groups


def _config(**mamba: Any) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="rmsnorm",
                             add_bias_linear=False, position_embedding="none", vocab_size=100,
                             mamba=MambaConfig(**{**MAMBA, **mamba}), hybrid_pattern="MM")  # fmt: skip


def _mixer(config: TransformerConfig, dtype: torch.dtype = torch.float64) -> Mamba2Mixer:
    return Mamba2Mixer(config, ModelContext(Group.single("tp")), LayerSpec(), "decoder.layers.0.mixer").to(dtype)


def _reference(p: dict[str, torch.Tensor], x: torch.Tensor, m: MambaConfig, eps: float) -> torch.Tensor:
    """The mixer from its equations, one position at a time: ``x`` ``[b, s, hidden]`` (float64) → same shape."""
    b, s, hidden = x.shape
    d, H, G, N, P, K = m.expand * hidden, m.expand * hidden // m.head_dim, m.n_groups, m.d_state, m.head_dim, m.d_conv
    proj = x @ p["in_proj.weight"].T
    z, xbc, dt = proj[..., :d], proj[..., d : 2 * d + 2 * G * N], proj[..., 2 * d + 2 * G * N :]
    conv = p["conv1d.bias"].expand(b, s, -1).clone() if "conv1d.bias" in p else xbc.new_zeros(xbc.shape)
    for k in range(K):  # out[t] = bias + sum_k w[k] in[t - (K - 1) + k]: inputs before the sequence are zero
        shift = K - 1 - k
        conv[:, shift:] += p["conv1d.weight"][:, 0, k] * xbc[:, : s - shift]
    xbc = conv * torch.sigmoid(conv)
    xs, B, C = xbc[..., :d].reshape(b, s, H, P), xbc[..., d : d + G * N], xbc[..., d + G * N :]
    group_of_head = torch.arange(H) // (H // G)
    B, C = B.reshape(b, s, G, N)[:, :, group_of_head], C.reshape(b, s, G, N)[:, :, group_of_head]
    delta = torch.log1p(torch.exp(dt + p["dt_bias"])).clamp(*m.dt_limit)
    A = -torch.exp(p["A_log"])
    state, ys = x.new_zeros(b, H, P, N), []
    for t in range(s):
        state = torch.exp(delta[:, t] * A)[..., None, None] * state
        state = state + delta[:, t, :, None, None] * xs[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1) + p["D"][:, None] * xs[:, t])
    y = torch.stack(ys, 1).reshape(b, s, d)
    gate = z * torch.sigmoid(z)
    h = (y if m.norm_before_gate else y * gate).reshape(b, s, G, d // G)
    h = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).reshape(b, s, d) * p["norm.weight"]
    if m.norm_before_gate:
        h = h * gate
    return h @ p["out_proj.weight"].T


def _randomised(mixer: Mamba2Mixer) -> dict[str, torch.Tensor]:
    """Give the initialised-to-constant parameters (D, norm weight) random values too; returns every parameter."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        mixer.D.copy_(torch.randn(mixer.D.shape, generator=g))
        mixer.norm.weight.copy_(1 + 0.3 * torch.randn(mixer.norm.weight.shape, generator=g))
        mixer.dt_bias.add_(0.5 * torch.randn(mixer.dt_bias.shape, generator=g))
    return {n: p.detach() for n, p in mixer.named_parameters()}


@pytest.mark.parametrize(
    "extra",
    [{}, {"norm_before_gate": True}, {"dt_limit": (0.01, 0.05)}, {"n_groups": 1}, {"conv_bias": False}],
    ids=["default", "norm_before_gate", "dt_limit", "one_group", "no_conv_bias"],
)
def test_the_mixer_computes_the_mamba2_equations(extra: dict[str, Any]) -> None:
    config = _config(**extra)
    mixer = _mixer(config)
    params = _randomised(mixer)
    x = torch.randn(2, 13, 32, dtype=torch.float64)  # 13: not a multiple of the chunk size 5
    out = mixer(x.transpose(0, 1)).transpose(0, 1)
    assert config.mamba is not None
    torch.testing.assert_close(out, _reference(params, x, config.mamba, config.norm_eps), rtol=1e-10, atol=1e-12)


def test_the_mixer_equals_hugging_face_mamba2_with_the_same_weights() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    config = _config()
    m = config.mamba
    assert m is not None
    hf_config = transformers.Mamba2Config(
        hidden_size=32, num_heads=m.nheads(32), head_dim=m.head_dim, state_size=m.d_state, n_groups=m.n_groups,
        expand=m.expand, conv_kernel=m.d_conv, chunk_size=m.chunk_size, layer_norm_epsilon=config.norm_eps,
        use_bias=False, use_conv_bias=True, num_hidden_layers=1,
    )  # fmt: skip
    mixer = _mixer(config)
    hf = HFMixer(hf_config, 0).double().eval()
    hf.load_state_dict(_randomised(mixer), strict=True)  # the same names and layouts: export is a rename
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    with torch.no_grad():
        ours = mixer(x.transpose(0, 1)).transpose(0, 1)
        theirs = hf(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)  # HF's gated norm runs in float32


def test_the_output_at_t_does_not_depend_on_later_inputs() -> None:
    mixer = _mixer(_config())
    _randomised(mixer)
    x = torch.randn(11, 2, 32, dtype=torch.float64, requires_grad=True)
    out = mixer(x)
    for t in (0, 4, 9):
        (grad,) = torch.autograd.grad(out[t].sum(), x, retain_graph=True)
        assert grad[t + 1 :].abs().max() == 0, f"output {t} depends on later inputs"
        assert grad[: t + 1].abs().sum(-1).min() > 0, f"output {t} should depend on every earlier input"


def test_parameters_have_the_published_names_shapes_and_initialisation() -> None:
    config = _config(n_groups=2)
    mixer = _mixer(config, torch.float32)
    d, H, GN = 64, 8, 16
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters()}
    assert shapes == {
        "in_proj.weight": (2 * d + 2 * GN + H, 32), "conv1d.weight": (d + 2 * GN, 1, 4), "conv1d.bias": (d + 2 * GN,),
        "dt_bias": (H,), "A_log": (H,), "D": (H,), "norm.weight": (d,), "out_proj.weight": (32, d),
    }  # fmt: skip
    m = config.mamba
    assert m is not None
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= m.dt_min * (1 - 1e-5) and dt.max() <= m.dt_max * (1 + 1e-5)
    A = torch.exp(mixer.A_log.detach())
    assert A.min() >= m.a_init_range[0] and A.max() <= m.a_init_range[1]
    assert torch.equal(mixer.D.detach(), torch.ones(H)) and torch.equal(mixer.norm.weight.detach(), torch.ones(d))
    assert mixer.conv1d.weight.abs().max() <= 1 / math.sqrt(m.d_conv)
    assert mixer.conv1d.bias is not None and mixer.conv1d.bias.abs().max() <= 1 / math.sqrt(m.d_conv)
    std = mixer.in_proj.weight.std().item()
    assert abs(std - config.init_method_std) < 0.1 * config.init_method_std
    assert mixer.out_proj.weight.std().item() < mixer.in_proj.weight.std().item()  # scaled output init


def test_low_precision_parameters_run() -> None:
    config = TransformerConfig(**{**_config().to_dict(), "params_dtype": "bfloat16"})
    mixer = Mamba2Mixer(config, ModelContext(Group.single("tp")), LayerSpec(), "m")
    out = mixer(torch.randn(7, 2, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (7, 2, 32) and out.isfinite().all()


# ------------------------------------------------------------------------------------------ tensor parallelism
def _tp_config() -> TransformerConfig:
    return _config(n_groups=4)  # 8 heads, 4 groups: tp 4 holds 2 heads and 1 group per rank


def _train_step(model: GPTModel, tp: Group) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One backward pass: the loss, and the global (unsharded) weights and gradients."""
    torch.manual_seed(5)
    ids = torch.randint(0, 100, (2, 16))
    loss = model(ids, labels=ids)
    (loss * torch.linspace(0.5, 1.5, 16)).sum().backward()
    allreduce_sequence_parallel_grads(model, tp)
    with torch.no_grad():
        weights = model.global_state_dict()
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            param.copy_(param.grad)
        grads = model.global_state_dict()
    return loss.detach(), weights, grads


def _tp_run(tp: int, sp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    model = GPTModel(_tp_config(), tp=state.tp, sequence_parallel=sp, spec=LayerSpec(layer=MambaLayer))
    return _train_step(model, state.tp)


@pytest.mark.parametrize(("tp", "sp"), [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "tp2-sp"])
def test_mamba_layers_train_under_tensor_parallelism_like_one_process(tp: int, sp: bool) -> None:
    ref = GPTModel(_tp_config(), spec=LayerSpec(layer=MambaLayer))
    ref_loss, ref_weights, ref_grads = _train_step(ref, Group.single())
    assert "decoder.layers.1.mixer.in_proj.weight" in ref_weights
    for loss, weights, grads in run_distributed(_tp_run, tp, tp, sp):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert list(weights) == list(ref_weights)
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=0, msg=f"{name}: initial weight")
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{name}: grad")


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("fields", "tp", "message"),
    [
        ({"head_dim": 48}, 1, r"mamba.head_dim=48 does not divide d_inner = mamba.expand \* hidden_size = 64"),
        ({"n_groups": 3}, 1, r"mamba.n_groups=3 does not divide the 8 heads"),
        ({"n_groups": 2}, 4, r"mamba.n_groups=2 is not divisible by the tensor-parallel size 4: .*set n_groups"),
        ({"head_dim": 16, "n_groups": 1}, 8, r"the 4 heads .* not divisible by the tensor-parallel size 8"),
        ({"d_state": 0}, 1, r"mamba.d_state=0 must be a positive integer"),
        ({"dt_limit": (0.5, 0.1)}, 1, r"mamba.dt_limit=\(0.5, 0.1\) must be two numbers"),
        ({"a_init_range": (0.0, 16.0)}, 1, r"mamba.a_init_range=.* low > 0"),
        ({"dt_min": 0.5}, 1, r"mamba.dt_max=0.1 must be >= mamba.dt_min=0.5"),
        ({"scan": "cuda"}, 1, r"mamba.scan='cuda' is not one of auto, torch, triton"),
    ],
)
def test_mamba_config_problems_name_the_field_and_the_fix(fields: dict, tp: int, message: str) -> None:
    problems = MambaConfig(**{**MAMBA, **fields}).problems(32, tp)
    assert any(re.search(message, p) for p in problems), problems


def test_the_tp_rules_reach_check_parallel_and_the_mixer() -> None:
    config = _config(n_groups=2)
    config.check_parallel(2)
    with pytest.raises(ConfigError, match="mamba.n_groups=2 is not divisible by the tensor-parallel size 4"):
        config.check_parallel(4)
    with pytest.raises(ConfigError, match="needs TransformerConfig.mamba"):
        Mamba2Mixer(TransformerConfig(), ModelContext(Group.single("tp")), LayerSpec(), "m")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hybrid_pattern": "M*", "mamba": None}, "has Mamba layers (M) but mamba is not set; set mamba"),
        ({"hybrid_pattern": "ME"}, "has MoE layers (E) but moe is not set; set moe"),
        ({"hybrid_pattern": "M*-"}, "has 3 layers (characters other than |) but num_layers=2"),
        ({"hybrid_pattern": "MX"}, "unknown character(s) ['X']"),
        ({"hybrid_pattern": "M||M"}, "has an empty pipeline stage"),
        ({"mamba": {"d_stat": 8}}, "unknown mamba field(s) ['d_stat']"),
    ],
)
def test_hybrid_pattern_problems(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransformerConfig(**{**_config().to_dict(), **fields})
    assert message in str(info.value)


def test_mamba_and_the_pattern_round_trip_through_checkpoint_metadata() -> None:
    config = _config(dt_limit=(0.0, math.inf)).replace(hybrid_pattern="M|M")
    assert config.hybrid_layers == "MM"
    back = TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict())))  # lists and Infinity in JSON
    assert back == config and isinstance(back.mamba, MambaConfig) and back.mamba.dt_limit == (0.0, math.inf)
    assert TransformerConfig(mamba={}).mamba == MambaConfig()  # type: ignore[arg-type]
