"""The Mamba-2 / hybrid converters of ``mcore_models.hf_ssm`` against Hugging Face ``Mamba2ForCausalLM`` and
``NemotronHForCausalLM`` built from configs (random weights, float32, transformers' PyTorch path; no download).

HF -> mcore: GPTModel gives HF's logits (1e-5) and exports every tensor of the ``save_pretrained`` file back bit for
bit. mcore -> HF: a native hybrid model's export loads into the HF class with HF's logits equal to mcore's and imports
back bit for bit. Configs round-trip through the ``transformers`` config classes; what the classes cannot represent
is refused naming the feature.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from mcore_models import ConversionError, GPTModel, TransformerConfig, preset
from mcore_models.hf import hf_architecture, hf_to_mcore, mcore_to_hf
from mcore_models.hf_ssm import ssm_config_from_hf, ssm_config_to_hf
from mcore_models.mamba_config import MambaConfig
from tests._hf_ssm_cases import CASES, TOKENS, arch, hf_config, hf_logits, hf_model, mcore_config, native
from tests.export._helpers import randomize

transformers = pytest.importorskip("transformers")

CONFIG_CLASSES = {"mamba2": "Mamba2Config", "nemotron_h": "NemotronHConfig"}


def _saved(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes (the hub names)."""
    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _mcore_logits(model: GPTModel, ids: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, gather_logits=True)


def _hf_from_dict(hf_dict: dict[str, Any]) -> torch.nn.Module:
    cfg = getattr(transformers, CONFIG_CLASSES[hf_dict["model_type"]])(**hf_dict)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


# ------------------------------------------------------------------------------------------------- HF -> mcore
@pytest.mark.parametrize("name", list(CASES))
def test_hf_model_imports_with_its_logits_and_exports_exactly(name: str, tmp_path: Path) -> None:
    hf = hf_model(name)
    c = mcore_config(name)
    assert hf_architecture(c) == arch(name) == c.extra["hf_architecture"]
    sd = hf.state_dict()
    from_module = dict(hf_to_mcore(c, lambda k: sd[k]))  # NemotronH's module names are model.*, the hub's backbone.*
    hub = _saved(hf, tmp_path)
    from_hub = dict(hf_to_mcore(c, lambda k: hub[k]))
    assert set(from_hub) == set(from_module)
    assert all(torch.equal(from_hub[k], v) for k, v in from_module.items())
    model = GPTModel(c).eval()
    model.load_global_state_dict(from_hub)
    torch.testing.assert_close(_mcore_logits(model), hf_logits(hf), rtol=1e-5, atol=1e-5)
    ours = model.global_state_dict()
    back = dict(mcore_to_hf(c, lambda k: ours[k]))
    assert set(back) == set(hub)
    for k, v in hub.items():
        assert torch.equal(back[k], v), k


def test_mixer_tensors_have_the_documented_names_and_shapes() -> None:
    c = mcore_config("nemotron-h")
    sd = hf_model("nemotron-h").state_dict()
    ours = {k: tuple(v.shape) for k, v in hf_to_mcore(c, lambda k: sd[k])}
    d, gn, heads = 128, 2 * 16, 8
    m = "decoder.layers.3.mixer"
    assert ours[f"{m}.in_proj.weight"] == (2 * d + 2 * gn + heads, 64)
    assert ours[f"{m}.conv1d.weight"] == (d + 2 * gn, 1, 4) and ours[f"{m}.conv1d.bias"] == (d + 2 * gn,)
    assert ours[f"{m}.dt_bias"] == ours[f"{m}.A_log"] == ours[f"{m}.D"] == (heads,)
    assert ours[f"{m}.norm.weight"] == (d,) and ours[f"{m}.out_proj.weight"] == (64, d)
    assert ours["decoder.layers.1.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 16, 64)
    assert ours["decoder.layers.2.mlp.linear_fc1.weight"] == (96, 64)
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in ours and "decoder.layers.1.input_layernorm.weight" in ours
    assert "output_layer.weight" in ours


def test_old_mamba2_embedding_name_imports() -> None:
    c = mcore_config("mamba2-g1")
    sd = dict(hf_model("mamba2-g1").state_dict())
    sd["backbone.embedding.weight"] = sd.pop("backbone.embeddings.weight")
    ours = dict(hf_to_mcore(c, lambda k: sd[k]))
    assert torch.equal(ours["embedding.word_embeddings.weight"], sd["backbone.embedding.weight"])
    del sd["backbone.norm_f.weight"]
    with pytest.raises(KeyError, match=r"backbone\.norm_f\.weight"):
        dict(hf_to_mcore(c, lambda k: sd[k]))


# ------------------------------------------------------------------------------------------------- mcore -> HF
NATIVE = {
    "mamba-tied": ("MMM", True, "Mamba2ForCausalLM"),
    "mamba-untied": ("MM", False, "Mamba2ForCausalLM"),
    "hybrid": ("M*-M-", False, "NemotronHForCausalLM"),
    "hybrid-tied-stages": ("*-M|M-", True, "NemotronHForCausalLM"),
}


@pytest.mark.parametrize("name", list(NATIVE))
def test_mcore_model_exports_with_its_logits_and_imports_exactly(name: str) -> None:
    pattern, tied, expected_arch = NATIVE[name]
    c = native(pattern, tied=tied)
    assert hf_architecture(c) == expected_arch
    model = randomize(GPTModel(c)).eval()
    ours = model.global_state_dict()
    hf_dict = ssm_config_to_hf(c)
    tensors = dict(mcore_to_hf(c, lambda k: ours[k]))
    hf = _hf_from_dict(hf_dict)
    prefix = "model." if expected_arch == "NemotronHForCausalLM" else "backbone."  # the module's names
    missing, unexpected = hf.load_state_dict({k.replace("backbone.", prefix): v for k, v in tensors.items()},
                                             strict=False)  # fmt: skip
    assert not unexpected and missing == (["lm_head.weight"] if tied and expected_arch == "Mamba2ForCausalLM" else [])
    assert torch.equal(
        hf.lm_head.weight, ours["embedding.word_embeddings.weight"] if tied else ours["output_layer.weight"]
    )
    expected = _mcore_logits(model)
    torch.testing.assert_close(hf_logits(hf), expected, rtol=1e-5, atol=1e-5)
    back = dict(hf_to_mcore(c, lambda k: tensors[k]))
    assert set(back) == set(ours)
    for k, v in ours.items():
        assert torch.equal(back[k], v), k
    imported = ssm_config_from_hf(hf.config.to_dict())  # the config a re-import builds
    again = GPTModel(imported).eval()
    again.load_global_state_dict(dict(hf_to_mcore(imported, lambda k: tensors[k])))
    torch.testing.assert_close(_mcore_logits(again), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", list(CASES))
def test_config_round_trips_through_transformers(name: str) -> None:
    c = mcore_config(name)
    hf_dict = ssm_config_to_hf(c)
    cls = getattr(transformers, CONFIG_CLASSES[hf_dict["model_type"]])
    assert ssm_config_from_hf(cls(**hf_dict).to_dict()) == c
    original = hf_config(name)
    keys = ["hidden_size", "num_hidden_layers", "vocab_size", "n_groups", "conv_kernel", "chunk_size", "expand",
            "use_conv_bias", "layer_norm_epsilon", "tie_word_embeddings", "time_step_max",
            "time_step_floor"]  # fmt: skip
    if hf_dict["model_type"] == "mamba2":
        keys += ["state_size", "num_heads", "head_dim", "time_step_min", "time_step_limit"]
    else:
        keys += ["ssm_state_size", "mamba_num_heads", "mamba_head_dim", "time_step_limit", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"]  # fmt: skip
        assert hf_dict["hybrid_override_pattern"] == original.hybrid_override_pattern == c.hybrid_pattern
        # transformers before 5.25 clamp NemotronH's time step at time_step_min: the export's is the clamp's bound
        assert hf_dict["time_step_min"] == max(original.time_step_limit[0], torch.finfo(torch.float32).tiny)
    for key in keys:
        want = getattr(original, key)
        assert hf_dict[key] == (list(want) if isinstance(want, tuple) else want), key


def test_configs_map_to_mcore_fields() -> None:
    m2 = mcore_config("mamba2-g2-tied-clamped")
    assert m2.hybrid_pattern == "MM" and m2.share_embeddings_and_output_weights and m2.position_embedding == "none"
    assert m2.mamba == MambaConfig(d_state=16, d_conv=4, expand=2, head_dim=16, n_groups=2, chunk_size=8,
                                   dt_limit=(0.05, 0.8), conv_bias=False)  # fmt: skip
    nh = mcore_config("nemotron-h-mha")
    assert (nh.hybrid_pattern, nh.activation, nh.num_query_groups, nh.kv_channels) == ("*-M", "squared_relu", 4, 16)
    assert nh.mamba is not None and nh.mamba.dt_limit == (0.3, math.inf) and nh.mamba.dt_min == 0.001
    assert (nh.mamba.d_conv, nh.mamba.n_groups, nh.norm_eps) == (3, 1, 1e-6)
    assert not nh.share_embeddings_and_output_weights and nh.ffn_size == 96
    out = ssm_config_to_hf(nh)
    assert out["time_step_min"] == 0.3 and out["mlp_hidden_act"] == "relu2" and not out["tie_word_embeddings"]
    # transformers 5 writes infinity as {"__float__": "Infinity"} in config.json
    inf = {"__float__": "Infinity"}
    assert (
        mcore_config("mamba2-g1").mamba
        == ssm_config_from_hf({**hf_config("mamba2-g1").to_dict(), "time_step_limit": [0.0, inf]}).mamba
    )


def test_native_configs_round_trip() -> None:
    hybrid = native("M*-M-", tied=False)
    out = ssm_config_to_hf(hybrid)
    assert out["time_step_min"] == torch.finfo(torch.float32).tiny and out["time_step_limit"] == [0.0, math.inf]
    assert ssm_config_from_hf(out) == hybrid.replace(kv_channels=16, extra={"hf_architecture": "NemotronHForCausalLM"})
    mamba = native("MMM", mamba=MambaConfig(d_state=16, head_dim=16, n_groups=2, chunk_size=8, dt_min=0.01,
                                            dt_limit=(0.001, 2.0), d_conv=2, expand=3))  # fmt: skip
    back = ssm_config_from_hf(ssm_config_to_hf(mamba))
    for field in ("hybrid_pattern", "mamba", "hidden_size", "vocab_size", "norm_eps", "normalization",
                  "share_embeddings_and_output_weights", "init_method_std"):  # fmt: skip
        assert getattr(back, field) == getattr(mamba, field), field
    no_mamba = native("*-*-", mamba=None)  # attention + MLP pairs only: NemotronH, no Mamba fields
    out = ssm_config_to_hf(no_mamba)
    assert out["architectures"] == ["NemotronHForCausalLM"] and "mamba_num_heads" not in out
    assert ssm_config_from_hf(out).mamba is None


def test_architecture_hint_and_stage_boundaries() -> None:
    assert hf_architecture(native("MMM", extra={"hf_architecture": "NemotronHForCausalLM"})) == "NemotronHForCausalLM"
    out = ssm_config_to_hf(native("M*|-M"))
    assert out["hybrid_override_pattern"] == "M*-M" and out["num_hidden_layers"] == 4


def test_unrepresentable_mcore_settings_are_named() -> None:
    hybrid = native("M*-M-", tied=False)
    m = hybrid.mamba
    assert m is not None
    for config, field in (
        (native("MMM", mamba=MambaConfig(d_state=16, head_dim=16, chunk_size=8, norm_before_gate=True)),
         "norm_before_gate"),
        (native("MMM", normalization="layernorm"), "normalization=layernorm"),
        (native("MMM", position_embedding="learned_absolute"), "learned_absolute"),
        (native("M*-", extra={"hf_architecture": "Mamba2ForCausalLM"}), r"layers \['\*', '-'\]"),
        (hybrid.replace(position_embedding="rope"), "position_embedding=rope"),
        (hybrid.replace(qk_layernorm=True), "qk_layernorm"),
        (hybrid.replace(add_bias_linear=True), "add_bias_linear"),
        (hybrid.replace(add_qkv_bias=True), "add_qkv_bias"),
        (hybrid.replace(activation="swiglu"), "activation=swiglu .a gated MLP"),
        (hybrid.replace(activation="gelu"), "activation=gelu"),
        (hybrid.replace(mamba=MambaConfig(**{**m.to_dict(), "dt_limit": (0.0, 4.0)})), "dt_limit"),
        (hybrid.replace(hybrid_pattern="M*-ME", moe={"num_experts": 4}), "MoE layers"),
    ):  # fmt: skip
        with pytest.raises(ConversionError, match=field):
            hf_architecture(config)
        with pytest.raises(ConversionError, match=field):
            dict(mcore_to_hf(config, lambda k: torch.zeros(1)))
    # features without layers that use them are no obstacle: RoPE in a pure Mamba model, swiglu without MLP layers
    assert hf_architecture(native("M*M", activation="swiglu")) == "NemotronHForCausalLM"
    assert hf_architecture(native("MM", position_embedding="rope")) == "Mamba2ForCausalLM"


def test_unsupported_hf_settings_are_named() -> None:
    m2 = hf_config("mamba2-g1").to_dict()
    for change, field in (({"hidden_act": "gelu"}, "hidden_act='gelu'"), ({"use_bias": True}, "use_bias"),
                          ({"rms_norm": False}, "rms_norm=False"),
                          ({"num_heads": 5, "head_dim": 10}, "not a multiple of hidden_size")):  # fmt: skip
        with pytest.raises(ConversionError, match=field):
            ssm_config_from_hf({**m2, **change})
    nh = hf_config("nemotron-h").to_dict()
    for change, field in (
        ({"layers_block_type": None, "hybrid_override_pattern": "M*-E"}, "MoE layers"),
        ({"layers_block_type": ["mamba", "mlp"]}, "layers_block_type holds"),
        ({"sliding_window": 128}, "sliding_window=128"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"use_bias": True}, "use_bias"),
        ({"architectures": ["JambaForCausalLM"]}, "JambaForCausalLM"),
    ):
        with pytest.raises(ConversionError, match=field):
            ssm_config_from_hf({**nh, **change})


def test_settings_transformers_ignores_are_imported_as_it_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mcore_models.hf_ssm"):
        c = ssm_config_from_hf({**hf_config("mamba2-g1").to_dict(), "norm_before_gate": True})
        assert c.mamba is not None and not c.mamba.norm_before_gate
        nh = ssm_config_from_hf({**hf_config("nemotron-h").to_dict(), "attention_bias": True,
                                 "num_nextn_predict_layers": 1, "tie_word_embeddings": True})  # fmt: skip
        assert not nh.add_bias_linear and not nh.share_embeddings_and_output_weights
    text = caplog.text
    assert "norm_before_gate" in text and "attention_bias" in text and "multi-token" in text


def test_config_without_pattern_is_not_converted_here() -> None:
    from mcore_models.hf_ssm import ssm_architecture

    with pytest.raises(ConversionError, match="no hybrid_pattern"):
        ssm_architecture(TransformerConfig())


@pytest.mark.parametrize("name", ["mamba2-130m", "nemotron-h-8b"])
def test_presets_export_with_the_hf_models_shapes(name: str) -> None:
    """Full-size presets on the meta device: every exported tensor has the HF model's name and shape."""
    c = preset(name)
    infos = {i.key: i for i in GPTModel(c, device="meta").sharded_state_dict().values()}
    ours = {k: tuple(v.shape) for k, v in mcore_to_hf(c, lambda k: torch.empty(infos[k].global_shape, device="meta"))}
    hf_dict = ssm_config_to_hf(c)
    with torch.device("meta"):
        hf = _hf_from_dict(hf_dict)
    theirs = {k.replace("model.", "backbone.", 1): tuple(v.shape) for k, v in hf.state_dict().items()}
    if name == "mamba2-130m":  # tied: no lm_head in the file
        assert hf_dict["architectures"] == ["Mamba2ForCausalLM"] and hf_dict["num_heads"] == 24
        del theirs["lm_head.weight"]
    else:
        assert hf_dict["hybrid_override_pattern"] == c.hybrid_pattern and hf_dict["mamba_num_heads"] == 128
        assert ssm_config_from_hf(hf_dict) == c.replace(extra={"hf_architecture": "NemotronHForCausalLM"})
    assert ours == theirs


def test_llama_style_hybrid_presets_are_refused() -> None:
    with pytest.raises(ConversionError, match=r"position_embedding=rope .*activation=swiglu \(a gated MLP\)"):
        hf_architecture(preset("hybrid-tiny"))
