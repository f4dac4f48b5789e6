"""The MoE converters of ``mcore_models.hf_moe`` against Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE built from
configs (random weights, no download).

Key layouts: every HF tensor (the module's fused experts and ``save_pretrained``'s per-expert hub files) maps to the
documented mcore names and shapes and back bit for bit; configs round-trip through the ``transformers`` config
classes; unrepresentable settings are refused naming the field. With the MoE layer, GPTModel gives HF's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mcore_models import ConversionError, GPTModel, TransformerConfig
from mcore_models.hf import hf_architecture, hf_to_mcore, mcore_to_hf
from mcore_models.hf_moe import hf_moe_layers, moe_config_from_hf, moe_config_to_hf
from mcore_models.moe import MoEConfig
from tests._hf_moe_cases import CASES, CONFIG_CLASSES, hf_config, hf_model, mcore_config

transformers = pytest.importorskip("transformers")


def _expected_shapes(c: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The mcore names and global shapes of the MoE-specific tensors the brief documents."""
    assert c.moe is not None
    h, e, f = c.hidden_size, c.moe.num_experts, c.moe.expert_ffn(c.ffn_size)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.num_layers):
        m = f"decoder.layers.{i}.mlp"
        if not c.moe.is_moe_layer(i):
            out.update({f"{m}.linear_fc1.weight": (2 * c.ffn_size, h), f"{m}.linear_fc2.weight": (h, c.ffn_size)})
            continue
        out.update({f"{m}.router.weight": (e, h), f"{m}.experts.linear_fc1.weight": (e, 2 * f, h),
                    f"{m}.experts.linear_fc2.weight": (e, h, f)})  # fmt: skip
        fs = c.moe.shared_expert_ffn_hidden_size
        if fs is not None:
            out.update({f"{m}.shared_experts.linear_fc1.weight": (2 * fs, h),
                        f"{m}.shared_experts.linear_fc2.weight": (h, fs), f"{m}.shared_experts.gate.weight": (1, h)})  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", list(CASES))
def test_config_round_trips_through_transformers(name: str) -> None:
    c = mcore_config(name)
    assert c.moe is not None and c.extra["hf_architecture"] == hf_architecture(c)
    hf_dict = moe_config_to_hf(c)
    cls = getattr(transformers, CONFIG_CLASSES[hf_dict["model_type"]])
    back = moe_config_from_hf(cls(**hf_dict).to_dict())
    assert back == c
    original = hf_config(name).to_dict()
    for key in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "intermediate_size", "head_dim", "num_key_value_heads",
                "tie_word_embeddings", "rms_norm_eps"):  # fmt: skip
        if key in original and original[key] is not None and key in hf_dict:
            assert hf_dict[key] == original[key], key
    experts = original.get("num_local_experts") or original.get("num_experts")
    assert experts == hf_dict.get("num_local_experts", hf_dict.get("num_experts"))


def test_routing_and_sparse_layers_map_to_mcore() -> None:
    mix = mcore_config("mixtral")
    assert mix.moe == MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2, router_pre_softmax=False,
                                aux_loss_coeff=0.001)  # fmt: skip
    assert (mix.rotary_base, mix.add_qkv_bias, mix.qk_layernorm) == (50000.0, False, False)
    q2 = mcore_config("qwen2-moe-step2")
    assert q2.moe is not None and q2.moe.layer_freq == [0, 1, 0, 1] and q2.moe.router_pre_softmax
    assert (q2.moe.shared_expert_ffn_hidden_size, q2.moe.shared_expert_gate, q2.add_qkv_bias) == (40, True, True)
    assert q2.ffn_size == 48 and q2.moe.expert_ffn(q2.ffn_size) == 32
    assert moe_config_to_hf(q2)["decoder_sparse_step"] == 2 and moe_config_to_hf(q2)["mlp_only_layers"] == []
    q3 = mcore_config("qwen3-moe")
    assert q3.moe is not None and q3.moe.layer_freq == [1, 0, 1] and not q3.moe.router_pre_softmax
    assert (q3.qk_layernorm, q3.kv_channels, q3.add_qkv_bias) == (True, 32, False)
    assert moe_config_to_hf(q3)["mlp_only_layers"] == [1]
    assert mcore_config("qwen3-moe-no-norm").moe.router_pre_softmax  # type: ignore[union-attr]
    no_bias = moe_config_from_hf({**hf_config("qwen2-moe-step2").to_dict(), "qkv_bias": False})
    assert not no_bias.add_qkv_bias and moe_config_to_hf(no_bias)["qkv_bias"] is False


@pytest.mark.parametrize(
    ("step", "mlp_only", "n"), [(1, [], 4), (2, [], 4), (3, [], 6), (1, [0, 3], 4), (2, [1], 4), (4, [], 3)]
)
def test_sparse_layer_patterns_round_trip(step: int, mlp_only: list[int], n: int) -> None:
    flags = hf_moe_layers(step, mlp_only, n)
    if not any(flags):
        return
    base = {**hf_config("qwen3-moe").to_dict(), "num_hidden_layers": n}
    c = moe_config_from_hf({**base, "decoder_sparse_step": step, "mlp_only_layers": mlp_only})
    assert c.moe is not None and [int(c.moe.is_moe_layer(i)) for i in range(n)] == flags
    out = moe_config_to_hf(c)
    assert hf_moe_layers(out["decoder_sparse_step"], out["mlp_only_layers"], n) == flags


def test_mcore_layer_freq_int_exports_as_hf_layers() -> None:
    c = mcore_config("qwen3-moe").replace(num_layers=4, moe=MoEConfig(num_experts=4, layer_freq=2, ffn_hidden_size=8))
    out = moe_config_to_hf(c)  # mcore's layer_freq=2 is layers 0 and 2 (0-based), HF's step counts from 1
    assert hf_moe_layers(out["decoder_sparse_step"], out["mlp_only_layers"], 4) == [1, 0, 1, 0]


def test_unsupported_hf_settings_are_named() -> None:
    mix = hf_config("mixtral").to_dict()
    with pytest.raises(ConversionError, match="sliding_window=4096"):
        moe_config_from_hf({**mix, "sliding_window": 4096})
    q3 = hf_config("qwen3-moe").to_dict()
    for change, field in (({"use_sliding_window": True}, "use_sliding_window"),
                          ({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"num_experts": 0}, "num_experts"),
                          ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn")):  # fmt: skip
        with pytest.raises(ConversionError, match=field):
            moe_config_from_hf({**q3, **change})
    with pytest.raises(ConversionError, match="shared_expert_intermediate_size"):
        moe_config_from_hf({**hf_config("qwen2-moe-step2").to_dict(), "shared_expert_intermediate_size": 0})


def test_unrepresentable_mcore_settings_are_named() -> None:
    mix, q2, q3 = mcore_config("mixtral"), mcore_config("qwen2-moe-step2"), mcore_config("qwen3-moe")
    assert mix.moe is not None and q2.moe is not None
    for config, field in (
        (mix.replace(moe=mix.moe.__class__(**{**mix.moe.to_dict(), "router_enable_expert_bias": True})),
         "router_enable_expert_bias"),
        (mix.replace(moe=MoEConfig(num_experts=4, router_score_function="sigmoid")), "router_score_function"),
        (mix.replace(moe=MoEConfig(num_experts=4, router_topk_scaling_factor=2.5)), "router_topk_scaling_factor"),
        (mix.replace(moe=MoEConfig(num_experts=4, router_num_groups=2, router_group_topk=1)), "router_num_groups"),
        (mix.replace(moe=MoEConfig(num_experts=4, router_pre_softmax=True)), "router_pre_softmax"),
        (mix.replace(moe=MoEConfig(num_experts=4, layer_freq=[1, 0])), "dense layers"),
        (mix.replace(qk_layernorm=True), "qk_layernorm"),
        (q2.replace(moe=MoEConfig(num_experts=8, shared_expert_ffn_hidden_size=40)), "gated shared expert"),
        (q2.replace(qk_layernorm=True), "qk_layernorm"),
        (q3.replace(qk_layernorm=False), "qk_layernorm=False"),
        (q3.replace(rope_scaling={"factor": 8.0}), "rope_scaling"),
    ):  # fmt: skip
        with pytest.raises(ConversionError, match=field):
            hf_architecture(config)


def test_architecture_is_inferred_without_a_hint() -> None:
    def bare(name: str) -> TransformerConfig:
        return mcore_config(name).replace(extra={})

    assert hf_architecture(bare("mixtral")) == "MixtralForCausalLM"
    assert hf_architecture(bare("qwen2-moe-step2")) == "Qwen2MoeForCausalLM"
    assert hf_architecture(bare("qwen3-moe")) == "Qwen3MoeForCausalLM"


# ------------------------------------------------------------------------------------------------ state dicts
@pytest.mark.parametrize("name", list(CASES))
def test_fused_module_state_dict_round_trips(name: str) -> None:
    hf = hf_model(name)
    sd = hf.state_dict()
    c = mcore_config(name)
    ours = dict(hf_to_mcore(c, lambda k: sd[k]))
    for key, shape in _expected_shapes(c).items():
        assert tuple(ours[key].shape) == shape, key
    assert not any("expert_bias" in k for k in ours)
    back = dict(mcore_to_hf(c, lambda k: ours[k], expert_layout="fused"))
    expected = {k: v for k, v in sd.items() if not (k == "lm_head.weight" and c.share_embeddings_and_output_weights)}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe-step2", "qwen3-moe"])
def test_hub_files_round_trip_and_match_the_module(name: str, tmp_path: Path) -> None:
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        hub = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    c = mcore_config(name)
    from_hub = dict(hf_to_mcore(c, lambda k: hub[k]))
    sd = hf.state_dict()
    from_module = dict(hf_to_mcore(c, lambda k: sd[k]))
    assert set(from_hub) == set(from_module)
    for k, v in from_module.items():
        assert torch.equal(from_hub[k], v), k
    back = dict(mcore_to_hf(c, lambda k: from_hub[k]))
    assert set(back) == set(hub)
    for k, v in hub.items():
        assert torch.equal(back[k], v), k
    if name == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in back


def test_missing_expert_names_the_hub_key() -> None:
    hf = hf_model("qwen3-moe")
    sd = {k: v for k, v in hf.state_dict().items() if k != "model.layers.2.mlp.experts.gate_up_proj"}
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.0\.gate_proj\.weight"):
        dict(hf_to_mcore(mcore_config("qwen3-moe"), lambda k: sd[k]))


# ------------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("name", list(CASES))
def test_gpt_model_matches_hf_logits(name: str) -> None:
    hf = hf_model(name)
    sd = hf.state_dict()
    c = mcore_config(name)
    model = GPTModel(c).eval()
    model.load_global_state_dict(dict(hf_to_mcore(c, lambda k: sd[k])))
    ids = torch.randint(0, c.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        logits = model(ids, gather_logits=True)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    ours = model.global_state_dict()
    back = dict(mcore_to_hf(c, lambda k: ours[k], expert_layout="fused"))
    for k, v in sd.items():
        if k in back:
            assert torch.equal(back[k], v), k
