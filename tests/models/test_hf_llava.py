"""LlavaModel against transformers' LlavaForConditionalGeneration (built from configs with random weights, never
downloaded, float64): import gives HF's logits for a batch with images, both directions are exact, an
mcore-initialised model exported loads in HF with the same logits, and what HF cannot represent is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import ConversionError
from mcore_models.hf_llava import (
    LLAVA_LAYOUTS,
    llava_config_from_hf,
    llava_config_to_hf,
    llava_hf_layout,
    llava_hf_to_mcore,
    llava_mcore_to_hf,
)
from mcore_models.multimodal import LlavaConfig, LlavaModel, llava_preset
from mcore_models.transformer.rope import rope_inv_freq
from mcore_models.vision import vision_preset
from tests._model_configs import gpt2, llama

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=16,
              patch_size=4)  # fmt: skip
TEXT = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)  # fmt: skip
IMAGE_TOKEN = 99
CASES: dict[str, dict[str, Any]] = {
    "clip": dict(tower="clip"),
    "clip-full-nobias-tied": dict(
        tower="clip",
        vision_feature_select_strategy="full",
        multimodal_projector_bias=False,
        tie=True,
        vision_feature_layer=-1,
    ),
    "siglip": dict(tower="siglip", vision_feature_select_strategy="full"),
}


@pytest.fixture(autouse=True)
def _llama_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two places where HF Llama does not compute in a float64 model's dtype: its RMSNorm casts to float32 (1e-8
    off) and its RoPE angles and cos / sin are float32 (1e-6 off). Here both compute in the input's dtype, as
    mcore's do once the model is ``.double()`` (mcore's inverse frequencies are float64 values rounded to float32,
    HF's are computed in float32, an ulp apart for some: HF takes mcore's), so the comparison sees the conversion
    and not float32 rounding."""
    llama = transformers.models.llama.modeling_llama

    def norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        inv_freq = rope_inv_freq(dim, c.rope_parameters["rope_theta"]).float().to(x.dtype)  # mcore's buffer
        freqs = position_ids[..., None].to(x.dtype) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", norm)
    monkeypatch.setattr(llama.LlamaRotaryEmbedding, "forward", rope)


def _exact(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=1e-10, msg=lambda m: f"{what}: {m}")


def _hf_config(tower: str = "clip", tie: bool = False, **kw: Any) -> Any:
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(**VISION)
    else:
        vision = transformers.SiglipVisionConfig(**VISION, vision_use_head=False)
    text = transformers.LlamaConfig(**TEXT, tie_word_embeddings=tie)
    drop = int(kw.get("vision_feature_select_strategy", "default") == "default")
    seq = (VISION["image_size"] // VISION["patch_size"]) ** 2 + int(tower == "clip") - drop
    fields = dict(image_token_index=IMAGE_TOKEN, image_seq_length=seq, tie_word_embeddings=tie, **kw)
    return transformers.LlavaConfig(vision_config=vision, text_config=text, **fields)


def _hf_model(hf_config: Any, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(hf_config).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to ones / zeros)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.double()


def _batch(image_tokens: int, image_token: int = IMAGE_TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 60 tokens: one image in the first row, two in the second (each ``image_tokens`` image tokens,
    as LLaVA's processor expands them), and three images of 16 x 16 pixels; text ids lie below the image token."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, image_token, (2, 60), generator=g)
    n = image_tokens
    ids[0, 3 : 3 + n] = image_token
    ids[1, 1 : 1 + n] = image_token
    ids[1, 2 + n : 2 + 2 * n] = image_token
    pixels = torch.randn(3, 3, 16, 16, generator=g, dtype=torch.float64)
    return ids, pixels


def _imported(hf_model: torch.nn.Module) -> LlavaModel:
    sd = hf_model.state_dict()
    config = llava_config_from_hf(hf_model.config.to_dict())
    model = LlavaModel(config)
    model.load_global_state_dict(dict(llava_hf_to_mcore(config, sd.__getitem__, llava_hf_layout(sd))))
    return model.double().eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor, pixels: torch.Tensor, hf: bool = False) -> torch.Tensor:
    with torch.no_grad():
        if hf:
            return model(input_ids=ids, pixel_values=pixels).logits
        return model(ids, pixels, gather_logits=True)


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits(case: str) -> None:
    hf = _hf_model(_hf_config(**CASES[case]))
    model = _imported(hf)
    assert model.config.image_tokens == hf.config.image_seq_length
    ids, pixels = _batch(model.config.image_tokens)
    ref = _logits(hf, ids, pixels, hf=True)
    assert ref.shape == (2, 60, 100)
    _exact(_logits(model, ids, pixels), ref, case)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_mcore_to_hf_is_bit_exact(case: str, tmp_path: Any) -> None:
    hf = _hf_model(_hf_config(**CASES[case]))
    sd = hf.state_dict()
    config = llava_config_from_hf(hf.config.to_dict())
    ours = dict(llava_hf_to_mcore(config, sd.__getitem__, "module"))
    back = dict(llava_mcore_to_hf(config, ours.__getitem__, "module"))
    if config.language.share_embeddings_and_output_weights:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied: HF's lm_head is the embedding
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    # the file save_pretrained writes (its own prefixes) and the Hub layout give the same tensors
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    from_file = dict(llava_hf_to_mcore(config, saved.__getitem__, llava_hf_layout(saved)))
    hub = dict(llava_mcore_to_hf(config, ours.__getitem__, "hub"))
    from_hub = dict(llava_hf_to_mcore(config, hub.__getitem__, llava_hf_layout(hub)))
    assert llava_hf_layout(hub) == LLAVA_LAYOUTS["hub"]
    assert llava_hf_layout(sd) == LLAVA_LAYOUTS["module"]
    for k, v in ours.items():
        assert torch.equal(from_file[k], v) and torch.equal(from_hub[k], v), k


def _native(config: LlavaConfig) -> LlavaModel:
    torch.manual_seed(3)
    model = LlavaModel(config)
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.double().eval()


def _tiny(**overrides: Any) -> LlavaConfig:
    return llava_preset("llava-tiny", **overrides)


NATIVE = {
    "patches": {},
    "all-tied-nobias": dict(
        vision_feature_select="all", projector_bias=False, language={"share_embeddings_and_output_weights": True}
    ),
    "siglip": dict(vision=vision_preset("tiny-siglip")),
}


@pytest.mark.parametrize("name", list(NATIVE))
def test_mcore_initialised_model_exports_to_hf(name: str) -> None:
    config = _tiny(**NATIVE[name])
    model = _native(config)
    fields = llava_config_to_hf(config)
    hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**fields)).double().eval()
    state = model.global_state_dict()
    exported = dict(llava_mcore_to_hf(config, state.__getitem__, "module"))
    loaded = hf.load_state_dict(exported, strict=False)
    tied = config.language.share_embeddings_and_output_weights
    assert not loaded.unexpected_keys and set(loaded.missing_keys) == ({"lm_head.weight"} if tied else set())
    ids, pixels = _batch(config.image_tokens, config.image_token_id)
    _exact(_logits(model, ids, pixels), _logits(hf, ids, pixels, hf=True), name)
    back = llava_config_from_hf(transformers.LlavaConfig(**fields).to_dict())
    assert _comparable(back) == _comparable(config)
    assert back.language.head_dim == config.language.head_dim


def _comparable(config: LlavaConfig) -> dict[str, Any]:
    """The config without what HF does not carry (free-form extras, freezing, init seeds, mcore's vocabulary
    padding; ``kv_channels=None`` is the head size HF states)."""
    d = config.to_dict()
    d.pop("freeze", None)
    for part in ("vision", "language"):
        for field in ("extra", "seed", "init_method_std", "hidden_dropout", "kv_channels",
                      "make_vocab_size_divisible_by"):  # fmt: skip
            d[part].pop(field, None)
    return d


def test_full_size_preset_names_and_shapes_match_hf() -> None:
    config = llava_preset("llava-1b-clip336")
    meta = {k: v for k, v in LlavaModel(config, device="meta").state_dict().items()}
    ours = {k: tuple(t.shape) for k, t in llava_mcore_to_hf(config, meta.__getitem__, "module")}
    with torch.device("meta"):
        hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**llava_config_to_hf(config)))
    theirs = {k: tuple(t.shape) for k, t in hf.state_dict().items()}
    if config.language.share_embeddings_and_output_weights:
        theirs.pop("lm_head.weight")
    assert ours == theirs


def test_hub_config_with_defaults_reads_as_transformers_does() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json leaves most fields to transformers' defaults."""
    hub = {
        "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
        "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                        "model_type": "llama", "rms_norm_eps": 1e-05, "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    }  # fmt: skip
    ours = llava_config_from_hf(hub)
    assert ours == llava_config_from_hf(transformers.LlavaConfig(**hub).to_dict())
    assert ours.image_tokens == 576 and ours.language.num_layers == 32 and ours.language.hidden_size == 4096
    assert ours.vision.vision_feature_layer == -2 and ours.vision.activation == "quick_gelu"
    bare = {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064}}
    assert llava_config_from_hf(bare).vision == ours.vision  # LlavaConfig's default tower


def test_what_hf_cannot_represent_is_refused_by_name() -> None:
    base = _tiny()
    lm = dict(vocab_size=base.language.vocab_size, hidden_size=base.language.hidden_size)
    for overrides, field in (
        (dict(pixel_shuffle=True), "pixel_shuffle=True"),
        (dict(projector="linear"), "projector='linear'"),
        (dict(language=gpt2(**lm)), "only a Llama language model.*GPT2LMHeadModel"),
        (dict(language=llama(**lm, qk_layernorm=True)), "language: LlamaForCausalLM cannot represent: qk_layernorm"),
        (dict(vision=base.vision.replace(pre_layernorm=False)), "vision tower: CLIPVisionModel .* pre_layernorm"),
        (dict(vision=vision_preset("tiny-siglip", pre_layernorm=True)), "vision tower: Siglip.* pre_layernorm"),
    ):
        config = base.replace(**overrides)
        with pytest.raises(ConversionError, match=field):
            llava_config_to_hf(config)
        with pytest.raises(ConversionError, match=field.split(" .*")[0]):
            next(llava_mcore_to_hf(config, lambda k: torch.zeros(1)))


def test_what_mcore_cannot_build_is_refused_on_import_by_name() -> None:
    good = _hf_config("clip").to_dict()
    for change, field in (
        ({"projector_hidden_act": "silu"}, "projector_hidden_act='silu'"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer=\\[-2, -1\\]"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy='cls'"),
        ({"image_seq_length": 5}, "image_seq_length=5"),
        ({"model_type": "llava_next"}, "model_type='llava_next'"),
        ({"image_token_index": 100}, "^invalid LlavaConfig \\(1 problem\\): image_token_id=100 is outside[^\\n]*$"),
        ({"text_config": {**good["text_config"], "model_type": "mistral"}}, "text_config.model_type='mistral'"),
        ({"vision_config": {**good["vision_config"], "model_type": "dinov2"}}, "vision_config.model_type='dinov2'"),
    ):
        with pytest.raises(ConversionError, match=field):
            llava_config_from_hf({**good, **change})
    siglip = _hf_config("siglip").to_dict()
    with pytest.raises(ConversionError, match="vision_feature_select_strategy='default' with a SigLIP"):
        llava_config_from_hf({**siglip, "vision_feature_select_strategy": "default", "image_seq_length": None})
