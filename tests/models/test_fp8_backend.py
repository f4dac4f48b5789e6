"""The layer-backend seam (mcore_models.backends) with the FP8 backend as its second implementation: which classes
each layer gets, parameter names and values identical across backends, checkpoints interchangeable in both
directions (FP8 scaling state optional), configuration and device errors naming the key to change, recompute."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_models import ConfigError, GPTModel, TransformerConfig
from mcore_models.backends import backend_classes, describe_backend, fp8_layers, layer_spec
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint, save_weights
from mcore_models.spec import default_spec
from mcore_models.transformer.attention import SDPACoreAttention
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.checkpoint import CheckpointManager
from mcore_parallel.fp8 import Fp8ColumnParallelLinear, Fp8Linear, Fp8RowParallelLinear, fp8_step
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tests._model_configs import llama
from tests.models._graphs import GraphRecorder

BASE = llama(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)


def _kinds(model: GPTModel) -> dict[str, str]:
    """Linear name -> "fp8" / "bf16" for every attention and MLP linear of the model."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and ".layers." in name:
            out[name] = "fp8" if isinstance(m, Fp8Linear) else "bf16"
    return out


def test_torch_backend_is_the_plain_spec() -> None:
    spec = default_spec()
    assert BASE.layer_backend == "torch" and layer_spec(spec, BASE, 1) is spec
    assert backend_classes(BASE).column_linear is ColumnParallelLinear
    assert set(_kinds(GPTModel(BASE)).values()) == {"bf16"}


def test_fp8_layers_and_linears_by_config() -> None:
    cfg = BASE.replace(fp8="hybrid")
    assert cfg.layer_backend == "fp8" and fp8_layers(cfg) == range(1, 3)  # first and last layers in bf16
    kinds = _kinds(GPTModel(cfg))
    for name, kind in kinds.items():
        layer = int(name.split(".")[2])
        assert kind == ("fp8" if layer in (1, 2) else "bf16"), name
    some = GPTModel(cfg.replace(fp8_modules=("qkv", "fc2"), fp8_first_layers_bf16=0, fp8_last_layers_bf16=0))
    for name, kind in _kinds(some).items():
        assert kind == ("fp8" if name.endswith(("linear_qkv", "linear_fc2")) else "bf16"), name
    assert isinstance(some.decoder.layers["3"].self_attention.linear_qkv, Fp8ColumnParallelLinear)
    assert isinstance(some.decoder.layers["3"].mlp.linear_fc2, Fp8RowParallelLinear)
    assert type(some.output_layer) is ColumnParallelLinear  # the output layer stays bf16
    assert "layers 1-2 of 4" in describe_backend(cfg)


def test_the_output_layer_runs_in_fp8_when_named() -> None:
    """``output`` in fp8_modules makes the output layer an FP8 linear (the default keeps it bf16): the same parameter
    as the bf16 model's, logits within FP8's error of the bf16 logits but not equal to them, its delayed-scaling state
    saved with the model, and a training step updates it."""
    mods = ("qkv", "proj", "fc1", "fc2", "output")
    cfg = BASE.replace(fp8="hybrid", fp8_recipe="delayed", fp8_modules=mods)
    model, plain = GPTModel(cfg), GPTModel(BASE)
    assert isinstance(model.output_layer, Fp8ColumnParallelLinear) and model.output_layer.runs_fp8
    assert type(GPTModel(BASE.replace(fp8="hybrid")).output_layer) is ColumnParallelLinear
    assert torch.equal(model.output_layer.weight, plain.output_layer.weight)
    assert "the output layer in FP8" in describe_backend(cfg) and "output layer," not in describe_backend(cfg)
    ids = torch.randint(0, BASE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    head_only = GPTModel(cfg.replace(fp8_modules=("output",)))
    with torch.no_grad():
        ref, got = plain(ids, gather_logits=True), head_only(ids, gather_logits=True)
    assert not torch.equal(got, ref)
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()  # E4M3: 3 mantissa bits on each operand
    before = model.output_layer.weight.detach().clone()
    _train_step(model, 0)
    assert not torch.equal(model.output_layer.weight, before)
    state = model.runtime_state_dict()
    assert state["output_layer.fp8_scaling.amax_history"].local.abs().sum() > 0


def test_the_callers_spec_wins_over_the_backend() -> None:
    """A slot the caller's spec changed (ring attention, a custom linear) is kept; the backend fills the defaults."""

    class MyColumn(ColumnParallelLinear):
        pass

    class MyCore(SDPACoreAttention):
        pass

    cfg = BASE.replace(fp8="hybrid", fp8_first_layers_bf16=0)
    spec = dataclasses.replace(default_spec(), column_linear=MyColumn, core_attention=MyCore)
    model = GPTModel(cfg, spec=spec)
    attention = model.decoder.layers["0"].self_attention
    assert type(attention.linear_qkv) is MyColumn and type(attention.core_attention) is MyCore
    assert isinstance(attention.linear_proj, Fp8RowParallelLinear)


def test_moe_experts_and_mamba_mixers_stay_bf16() -> None:
    moe = BASE.replace(fp8="hybrid", fp8_first_layers_bf16=0, fp8_last_layers_bf16=0,
                       moe={"num_experts": 4, "router_topk": 2, "shared_expert_ffn_hidden_size": 64})  # fmt: skip
    model = GPTModel(moe)
    layer = model.decoder.layers["1"]
    assert isinstance(layer.self_attention.linear_qkv, Fp8ColumnParallelLinear)
    assert not any(isinstance(m, Fp8Linear) for m in layer.mlp.modules())  # experts and shared experts: bf16
    hybrid = BASE.replace(fp8="hybrid", fp8_first_layers_bf16=0, fp8_last_layers_bf16=0, hybrid_pattern="M*-M",
                          mamba={"d_state": 16, "head_dim": 16, "n_groups": 1})  # fmt: skip
    kinds = {n: type(m).__name__ for n, m in GPTModel(hybrid).named_modules() if n.endswith(("in_proj", "linear_qkv",
                                                                                             "linear_fc1"))}  # fmt: skip
    assert kinds == {"decoder.layers.0.mixer.in_proj": "ColumnParallelLinear",
                     "decoder.layers.1.self_attention.linear_qkv": "Fp8ColumnParallelLinear",
                     "decoder.layers.2.mlp.linear_fc1": "Fp8ColumnParallelLinear",
                     "decoder.layers.3.mixer.in_proj": "ColumnParallelLinear"}  # fmt: skip


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_parameters_are_the_same_for_every_backend(recipe: str) -> None:
    plain, fp8 = GPTModel(BASE), GPTModel(BASE.replace(fp8="hybrid", fp8_recipe=recipe))
    assert [n for n, _ in fp8.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for (name, a), b in zip(fp8.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name  # the same initialisation
    assert list(fp8.sharded_state_dict()) == list(plain.sharded_state_dict())
    assert plain.runtime_state_dict() == {}
    assert bool(fp8.runtime_state_dict()) == (recipe == "delayed")


def _train_step(model: GPTModel, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, BASE.vocab_size, (2, 16))
    with fp8_step([model]):
        model(ids, labels=ids).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.zero_grad(set_to_none=True)


def _assert_same_parameters(a: GPTModel, b: GPTModel) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_checkpoints_interchange_between_backends(tmp_path: Path) -> None:
    """Weights saved by the torch backend load into the FP8 one and the other way round."""
    torch_model = GPTModel(BASE)
    _train_step(torch_model, 0)
    save_weights(torch_model, ParallelState.initialize(ParallelConfig()), tmp_path / "torch")
    fp8_model = GPTModel(BASE.replace(fp8="hybrid", seed=99))
    load_weights(fp8_model, tmp_path / "torch")
    _assert_same_parameters(fp8_model, torch_model)
    _train_step(fp8_model, 1)
    save_weights(fp8_model, ParallelState.initialize(ParallelConfig()), tmp_path / "fp8")
    back = GPTModel(BASE.replace(seed=7))
    load_weights(back, tmp_path / "fp8")
    _assert_same_parameters(back, fp8_model)
    # serving and export rebuild an FP8-trained checkpoint with the torch layers; a trainer may keep the backend
    assert model_config_from_checkpoint(tmp_path / "fp8") == BASE.replace(seed=99)
    assert model_config_from_checkpoint(tmp_path / "fp8", keep_backend=True).layer_backend == "fp8"


def _items(model: GPTModel) -> dict[str, Any]:
    return {**model.sharded_state_dict(), **model.runtime_state_dict()}


def test_delayed_scaling_state_round_trips_and_is_optional(tmp_path: Path) -> None:
    """The amax histories and scales are saved with the model and restored; a checkpoint without them (another
    backend) loads into a delayed-scaling model and leaves them fresh; a model without them ignores them."""
    state = ParallelState.initialize(ParallelConfig())
    cfg = BASE.replace(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=8)
    model = GPTModel(cfg)
    for seed in range(3):
        _train_step(model, seed)
    saved = {k: v.local.clone() for k, v in model.runtime_state_dict().items()}
    assert all(t.abs().sum() > 0 for t in saved.values())
    CheckpointManager(tmp_path / "fp8", state).save("step_1", _items(model))
    loaded = GPTModel(cfg.replace(seed=5))
    CheckpointManager(tmp_path / "fp8", state).load(_items(loaded))
    _assert_same_parameters(loaded, model)
    for key, info in loaded.runtime_state_dict().items():
        assert torch.equal(info.local, saved[key]), key
    _train_step(loaded, 3)  # the loaded scales are used as they are (not recomputed from the step's tensors)
    _train_step(model, 3)
    _assert_same_parameters(loaded, model)
    plain = GPTModel(BASE)
    CheckpointManager(tmp_path / "fp8", state).load(_items(plain))  # the extra arrays are not read
    CheckpointManager(tmp_path / "torch", state).save("step_1", _items(plain))
    fresh = GPTModel(cfg)
    CheckpointManager(tmp_path / "torch", state).load(_items(fresh))  # no histories in it: they stay empty
    assert all(info.local.abs().sum() == 0 for info in fresh.runtime_state_dict().values())
    _assert_same_parameters(fresh, plain)


@pytest.mark.parametrize(
    "changes,needle",
    [
        (dict(fp8="e5m2"), "fp8='e5m2' is not one of e4m3, hybrid"),
        (dict(fp8="hybrid", fp8_recipe="blockwise"), "fp8_recipe='blockwise' is not one of tensorwise, rowwise, delayed"),
        (dict(fp8="hybrid", fp8_recipe="rowwise"), "set fp8=e4m3"),
        (dict(fp8="hybrid", backend="torch"), "needs backend=fp8"),
        (dict(backend="fp8"), "backend=fp8 needs fp8=e4m3 or fp8=hybrid"),
        (dict(backend="te"), "backend='te' is not one of auto, torch, fp8"),
        (dict(fp8="hybrid", hidden_size=72, num_attention_heads=4, num_query_groups=4), "hidden_size=72 is not a multiple of 16"),
        (dict(fp8="hybrid", fp8_first_layers_bf16=2, fp8_last_layers_bf16=2), "leaves none of the 4 layers in FP8"),
        (dict(fp8="hybrid", fp8_modules=("qkv", "attn")), "unknown entries ['attn']"),
        (dict(fp8="hybrid", fp8_modules=("qkv", "output"), share_embeddings_and_output_weights=True),
         "fp8_modules names output but share_embeddings_and_output_weights=true"),
        (dict(fp8="hybrid", fp8_modules=("qkv", "output"), cross_entropy_fusion=True),
         "drop output from fp8_modules or set cross_entropy_fusion=false"),
        (dict(fp8="hybrid", fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo='mean'"),
    ],
)  # fmt: skip
def test_configuration_errors_name_the_key(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        BASE.replace(**changes)
    assert needle in str(e.value)


def test_old_gpu_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as e:
        GPTModel(BASE.replace(fp8="hybrid"), device="cuda")
    text = str(e.value)
    assert "A100" in text and "compute capability 8.0" in text and "8.9 or newer" in text
    assert "model.fp8=null" in text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    from mcore_parallel.fp8 import fp8_device_problem

    assert fp8_device_problem("cuda") is None and fp8_device_problem("cpu") is None


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_trains_like_keeping_activations(recompute: str) -> None:
    cfg = BASE.replace(fp8="hybrid", fp8_recipe="delayed", fp8_first_layers_bf16=0)
    keep, again = GPTModel(cfg), GPTModel(cfg.replace(recompute=recompute))
    for seed in range(2):
        _train_step(keep, seed)
        _train_step(again, seed)
    _assert_same_parameters(keep, again)
    for (key, a), b in zip(keep.runtime_state_dict().items(), again.runtime_state_dict().values()):
        assert torch.equal(a.local, b.local), key


def test_single_group_default() -> None:
    """GPTModel without a tp group builds FP8 linears on a one-member group (no collectives)."""
    model = GPTModel(BASE.replace(fp8="e4m3"))
    layer = model.decoder.layers["1"].self_attention.linear_qkv
    assert isinstance(layer, Fp8ColumnParallelLinear) and layer.tp.size == 1 and isinstance(layer.tp, Group)
    assert isinstance(model.config, TransformerConfig)


@pytest.mark.parametrize(
    "kw,needs",
    [
        (dict(fp8_recipe="tensorwise"), "fp8_recipe=delayed"),
        (dict(fp8=None, backend="torch", fp8_recipe="tensorwise"), "fp8=e4m3 or hybrid"),
        (dict(activation="gelu"), "activation=swiglu"),
        (dict(fp8_modules=("qkv", "fc1")), "fc1 and fc2 in fp8_modules"),
        (dict(add_bias_linear=True), "add_bias_linear=false"),
        (dict(fp8_wgrad=False), "fp8_wgrad=true"),
    ],
)
def test_fp8_fused_swiglu_is_refused_where_it_cannot_run(kw: dict, needs: str) -> None:
    with pytest.raises(ConfigError, match=f"fp8_fused_swiglu=true needs {needs}"):
        llama(**{"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
                 "ffn_hidden_size": 128, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_fused_swiglu": True, **kw})  # fmt: skip


@pytest.mark.parametrize(
    "kw,fused",
    [
        (dict(), True),  # delayed scaling, SwiGLU, fc1 and fc2 in FP8: the fused SwiGLU where unset
        (dict(fp8_fused_swiglu=False), False),
        (dict(fp8_recipe="tensorwise"), False),  # cannot run: off, not an error, when unset
        (dict(activation="gelu"), False),
        (dict(fp8_modules=("qkv", "proj")), False),
        (dict(fp8=None, backend="torch", fp8_recipe="tensorwise"), False),
    ],
)
def test_fp8_fused_swiglu_is_on_wherever_it_can_run_unless_turned_off(kw: dict, fused: bool) -> None:
    cfg = llama(**{"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
                   "ffn_hidden_size": 128, "fp8": "hybrid", "fp8_recipe": "delayed", **kw})  # fmt: skip
    assert cfg.fp8_fused_swiglu is kw.get("fp8_fused_swiglu") and cfg.fp8_swiglu_fused is fused
    model = GPTModel(cfg)
    assert model.decoder.layers["1"].mlp.fp8_fused is fused  # the FP8 layer's MLP takes the fused path
    assert model.decoder.layers["0"].mlp.fp8_fused is False  # the first layer stays bf16


@pytest.mark.parametrize("fused_swiglu", [True, False])
def test_compiled_fp8_layer_keeps_the_residual_add_and_the_mlp_norm_in_one_graph(fused_swiglu: bool) -> None:
    """The FP8 linears (and the fused FP8 MLP) run eagerly, a graph break in a compiled layer: the residual add after
    the attention and the pre-MLP norm must still be one graph (one kernel forward, and the residual's gradient summed
    inside its backward rather than by an eager add), with the layer's output and gradients those of eager mode."""
    cfg = BASE.replace(fp8="hybrid", fp8_recipe="delayed", fp8_first_layers_bf16=0, fp8_last_layers_bf16=0,
                       fp8_fused_swiglu=fused_swiglu)  # fmt: skip
    layer = GPTModel(cfg).decoder.layers["1"]
    record = GraphRecorder()
    x = torch.randn(16, 2, 64, requires_grad=True)
    with fp8_step([layer]):
        eager = layer(x, None)
        (gx_eager,) = torch.autograd.grad(eager.square().sum(), x)
        compiled = torch.compile(layer, backend=record)(x, None)
        (gx,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_eager, rtol=0, atol=0)
    norm_graphs = record.with_op("rms_norm")
    assert len(norm_graphs) == 2, record.graphs  # the input norm, then the pre-MLP norm
    assert "add" in norm_graphs[1], f"the residual add and the pre-MLP norm are in different graphs: {record.graphs}"
