"""The vision encoder against transformers' CLIPVisionModel and SiglipVisionModel (config-built, random weights,
float64), conversion both ways, and VisionConfig's errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import ConfigError, ConversionError, TransformerConfig
from mcore_models.hf import hf_architecture
from mcore_models.hf_vision import (
    hf_vision_prefix,
    vision_config_from_hf,
    vision_config_to_hf,
    vision_hf_architecture,
    vision_hf_to_mcore,
    vision_mcore_to_hf,
)
from mcore_models.transformer.mlp import activation_fn
from mcore_models.vision import VisionConfig, VisionEncoder, vision_preset

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=16,
             patch_size=4)  # fmt: skip
TOWERS = {
    "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
    "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
}


def _exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal up to float64 summation-order rounding."""
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _hf(kind: str, seed: int = 0, **kw: Any) -> tuple[Any, torch.nn.Module]:
    config_cls, model_cls = TOWERS[kind]
    hf_config = config_cls(**{**SMALL, **kw})
    torch.manual_seed(seed)
    model = model_cls(hf_config).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to ones / zeros)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    # float32 weights (the encoder is built in float32 and loads them exactly), then float64 for the comparison
    return hf_config, model.double()


def _imported(hf_config: Any, hf_model: torch.nn.Module, **overrides: Any) -> VisionEncoder:
    sd = hf_model.state_dict()
    config = vision_config_from_hf(hf_config.to_dict(), **overrides)
    enc = VisionEncoder(config)
    enc.load_global_state_dict(dict(vision_hf_to_mcore(config, sd.__getitem__, hf_vision_prefix(sd))))
    return enc.double().eval()


def _pixels(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


@pytest.mark.parametrize("kind", list(TOWERS))
def test_import_matches_transformers(kind: str) -> None:
    hf_config, hf_model = _hf(kind)
    enc = _imported(hf_config, hf_model, vision_feature_layer=-2)
    x = _pixels()
    with torch.no_grad():
        ref = hf_model(x, output_hidden_states=True)
        ours = enc.hidden_states(x)
        assert len(ours) == len(ref.hidden_states) == 4
        for i, (a, b) in enumerate(zip(ours, ref.hidden_states, strict=True)):
            _exact(a, b, f"hidden state {i}")
        _exact(enc(x), ref.hidden_states[-2])  # the chosen (LLaVA) layer
        _exact(enc.last_hidden_state(x), ref.last_hidden_state)
        if kind == "clip":
            _exact(enc.pooled_output(x), ref.pooler_output)
            assert enc(x).shape == (2, 17, 32)  # class token + 16 patches
        else:
            assert enc(x).shape == (2, 16, 32)
            with pytest.raises(ValueError, match="pooled_output needs"):
                enc.pooled_output(x)


@pytest.mark.parametrize("kind", list(TOWERS))
def test_export_matches_and_round_trip_is_exact(kind: str) -> None:
    hf_config, hf_model = _hf(kind, vision_use_head=False) if kind == "siglip" else _hf(kind)
    sd = hf_model.state_dict()
    enc = _imported(hf_config, hf_model)
    back = dict(vision_mcore_to_hf(enc.config, enc.state_dict().__getitem__))
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k

    # mcore → HF from a mcore-initialised encoder (no HF weights involved)
    config = vision_preset(f"tiny-{kind}", num_layers=3, ffn_hidden_size=48)
    native = VisionEncoder(config).double().eval()
    fields = vision_config_to_hf(config)
    model_cls = TOWERS[kind][1]
    exported = model_cls(TOWERS[kind][0](**fields)).double().eval()
    exported.load_state_dict(dict(vision_mcore_to_hf(config, native.state_dict().__getitem__)), strict=True)
    x = _pixels()
    with torch.no_grad():
        ref = exported(x, output_hidden_states=True)
        _exact(native(x), ref.hidden_states[config.vision_feature_layer])
        _exact(native.last_hidden_state(x), ref.last_hidden_state)
    assert vision_config_from_hf(fields, vision_feature_layer=config.vision_feature_layer).replace(
        extra={}, init_method_std=config.init_method_std
    ) == config.replace(extra={})


def test_feature_layer_stops_early_and_attention_is_bidirectional() -> None:
    config = vision_preset("tiny-clip", vision_feature_layer=1)
    enc = VisionEncoder(config).eval()
    ran: list[str] = []
    for key, layer in enc.decoder.layers.items():
        layer.register_forward_hook(lambda *_, k=key: ran.append(k))
    x = _pixels().float()
    with torch.no_grad():
        out = enc(x)
    assert ran == ["0"]  # the layers after the chosen one do not run
    assert torch.equal(out, enc.hidden_states(x)[1])
    # the first token sees the last patch: changing that patch changes the class token's output
    y = x.clone()
    y[:, :, -4:, -4:] += 1.0
    with torch.no_grad():
        assert not torch.allclose(enc(y)[:, 0], out[:, 0])
    # and the layer config really is non-causal (a causal stack would not let it)
    assert enc.layer_config.attention_causal is False
    first: Any = enc.decoder.layers["0"]
    assert first.self_attention.core_attention.causal is False


def test_quick_gelu_activation() -> None:
    x = torch.linspace(-4, 4, 9)
    torch.testing.assert_close(activation_fn("quick_gelu")(x), x * torch.sigmoid(1.702 * x))  # type: ignore[operator]
    assert TransformerConfig(activation="quick_gelu").activation == "quick_gelu"
    with pytest.raises(ConfigError, match="attention_causal"):
        TransformerConfig(attention_causal="no")  # type: ignore[arg-type]
    with pytest.raises(ConversionError, match="attention_causal=False"):  # no HF decoder is bidirectional
        hf_architecture(TransformerConfig(attention_causal=False))


def test_presets() -> None:
    clip = vision_preset("clip_vit_l14_336")
    assert (clip.num_patches, clip.seq_length, clip.feature_layers) == (576, 577, 23)
    assert vision_hf_architecture(clip) == "CLIPVisionModel"
    siglip = vision_preset("siglip-so400m-14-384")
    assert (siglip.grid_size, siglip.seq_length) == (27, 729)
    assert vision_hf_architecture(siglip) == "SiglipVisionModel"
    enc = VisionEncoder(clip, device="meta")  # the full-size shape builds (no memory)
    assert sum(p.numel() for p in enc.parameters()) == 303_507_456  # openai/clip-vit-large-patch14-336's tower
    with pytest.raises(KeyError, match="unknown vision preset"):
        vision_preset("vit-huge")


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(image_size=12, patch_size=14), "patch_size=14 is larger than image_size=12"),
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size=30 is not divisible by num_attention_heads"),
        (dict(activation="relu"), "activation='relu' is not one of"),
        (dict(post_layernorm="pooled"), "post_layernorm='pooled' is not one of"),
        (dict(position_embedding="rope_2d"), "position_embedding='rope_2d' is not one of"),
        (dict(num_layers=2, vision_feature_layer=-4), "vision_feature_layer=-4 must be an integer in [-3, 2]"),
        (dict(class_token=False, post_layernorm="class_token"), "needs class_token=true"),
        (dict(patch_size=0), "patch_size=0 must be a positive integer"),
        (dict(norm_eps=0.0), "norm_eps=0.0 must be positive"),
        (dict(attention_dropout=1.0), "attention_dropout=1.0 must be in [0, 1)"),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match="invalid VisionConfig") as err:
        VisionConfig(**fields)
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_parallel_and_conversion_errors() -> None:
    config = VisionConfig(num_attention_heads=4, hidden_size=64, ffn_hidden_size=6)
    with pytest.raises(ConfigError, match="tensor parallelism 4") as err:
        config.check_parallel(4)
    assert any("ffn_hidden_size=6" in p for p in err.value.problems)
    with pytest.raises(ConfigError, match=r"unknown VisionConfig field\(s\) \['heads'\]"):
        VisionConfig.from_dict({"heads": 3})
    assert VisionConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConversionError, match="CLIPVisionModel cannot represent: pre_layernorm=False"):
        vision_hf_architecture(vision_preset("tiny-clip", pre_layernorm=False))
    with pytest.raises(ConversionError, match="SiglipVisionModel .* post_layernorm='none'"):
        vision_hf_architecture(vision_preset("tiny-siglip", post_layernorm="none"))
    with pytest.raises(ConversionError, match="model_type='vit'"):
        vision_config_from_hf({"model_type": "vit"})
    with pytest.raises(ConversionError, match="hidden_act='relu'"):
        vision_config_from_hf({"model_type": "clip_vision_model", "hidden_act": "relu"})
    with pytest.raises(ValueError, match="the image gives 5 tokens"):
        VisionEncoder(vision_preset("tiny-clip"))(torch.zeros(1, 3, 8, 8))
