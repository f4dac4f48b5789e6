"""``LlavaConfig``: the validated description of a LLaVA-style vision-language model, and its presets.

A LLaVA model is a vision tower (:class:`~mcore_models.vision.VisionConfig`), a projector from the tower's width to
the language model's, and a GPT language model (:class:`~mcore_models.config.TransformerConfig`). Construction runs
:meth:`LlavaConfig.problems` and raises one :class:`~mcore_models.errors.ConfigError` listing every problem, each
naming its field. :meth:`LlavaConfig.to_dict` / :meth:`LlavaConfig.from_dict` round-trip through JSON (checkpoint
metadata, YAML recipes): the two sub-configs are stored as their own ``to_dict`` forms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mcore_models.config import TransformerConfig
from mcore_models.errors import ConfigError
from mcore_models.presets import preset
from mcore_models.vision.config import VisionConfig, vision_preset

__all__ = ["LlavaConfig", "LLAVA_PRESETS", "llava_preset", "PROJECTORS", "FEATURE_SELECTS", "FREEZABLE"]

PROJECTORS = ("mlp", "linear")
FEATURE_SELECTS = ("patches", "all")
FREEZABLE = ("vision", "projector", "language")
_HEADER = "invalid LlavaConfig"


@dataclass(frozen=True)
class LlavaConfig:
    """Vision tower + projector + language model (LLaVA-1.5 and its relatives)."""

    vision: VisionConfig
    """The vision tower (its ``vision_feature_layer`` picks the hidden state the projector reads)."""
    language: TransformerConfig
    """The language model."""
    image_token_id: int
    """The token id whose positions in ``input_ids`` receive the image embeddings (``image_tokens`` per image);
    a token of the language model's vocabulary."""
    projector: str = "mlp"
    """mlp: Linear -> GELU (exact) -> Linear (LLaVA-1.5's ``mlp2x_gelu``); linear: one Linear."""
    projector_bias: bool = True
    """Biases on the projector's linears."""
    pixel_shuffle: bool = False
    """2x2 token reduction before the projector (NVLM / InternVL): the patch grid ``(g, g, C)`` becomes
    ``(g/2, g/2, 4C)``; needs an even grid and no class token in the features."""
    vision_feature_select: str = "patches"
    """patches: the patch tokens only (the class token, when the tower has one, is dropped: HF LLaVA's
    ``default``); all: every token the tower gives (HF's ``full``)."""
    freeze: tuple[str, ...] = ()
    """Parts whose parameters are built with ``requires_grad=False``: any of vision, projector, language."""

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):  # the plain mapping a YAML file or checkpoint metadata gives
            object.__setattr__(self, "vision", VisionConfig.from_dict(self.vision))
        if isinstance(self.language, dict):
            object.__setattr__(self, "language", TransformerConfig.from_dict(self.language))
        if isinstance(self.freeze, list | str):
            freeze = (self.freeze,) if isinstance(self.freeze, str) else tuple(self.freeze)
            object.__setattr__(self, "freeze", freeze)
        problems = self.problems()
        if problems:
            raise ConfigError(problems, header=_HEADER)

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def feature_tokens(self) -> int:
        """Tokens per image after the feature selection, before the pixel shuffle."""
        v = self.vision
        return v.seq_length if self.vision_feature_select == "all" else v.num_patches

    @property
    def image_tokens(self) -> int:
        """LM tokens one image becomes (576 for CLIP ViT-L/14-336 with ``patches``; 144 with the pixel shuffle)."""
        return self.feature_tokens // 4 if self.pixel_shuffle else self.feature_tokens

    @property
    def projector_input_size(self) -> int:
        """Width of the projector's input: the tower's hidden size (times 4 after the pixel shuffle)."""
        return self.vision.hidden_size * (4 if self.pixel_shuffle else 1)

    # ------------------------------------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields: ``vision`` and ``language`` as their own ``to_dict`` forms, ``freeze`` a list."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(vision=self.vision.to_dict(), language=self.language.to_dict(), freeze=list(self.freeze))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlavaConfig:
        """Inverse of :meth:`to_dict`; unknown keys (here or in the sub-configs) are an error naming them."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError([f"unknown LlavaConfig field(s) {unknown}"], header=_HEADER)
        missing = sorted({"vision", "language", "image_token_id"} - set(data))
        if missing:
            raise ConfigError([f"missing LlavaConfig field(s) {missing}"], header=_HEADER)
        return cls(**data)

    def replace(self, **changes: Any) -> LlavaConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """Every problem with this config (empty when valid), each naming its field."""
        p: list[str] = []
        if not isinstance(self.vision, VisionConfig):
            p.append(f"vision={type(self.vision).__name__} must be a VisionConfig (or its to_dict form)")
        if not isinstance(self.language, TransformerConfig):
            p.append(f"language={type(self.language).__name__} must be a TransformerConfig (or its to_dict form)")
        tid = self.image_token_id
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            p.append(f"image_token_id={tid!r} must be a non-negative integer (a token id of the language model)")
        elif isinstance(self.language, TransformerConfig) and tid >= self.language.vocab_size:
            p.append(f"image_token_id={tid} is outside the language model's vocabulary (language.vocab_size="
                     f"{self.language.vocab_size}); use a token id below it")  # fmt: skip
        for name, allowed in (("projector", PROJECTORS), ("vision_feature_select", FEATURE_SELECTS)):
            if getattr(self, name) not in allowed:
                p.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("projector_bias", "pixel_shuffle"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name}={getattr(self, name)!r} must be true or false")
        p.extend(self._freeze_problems())
        if p:
            return p
        return self._shape_problems()

    def _freeze_problems(self) -> list[str]:
        if not isinstance(self.freeze, tuple) or not all(isinstance(f, str) for f in self.freeze):
            return [f"freeze={self.freeze!r} must be a list of part names ({', '.join(FREEZABLE)})"]
        p = []
        bad = [f for f in self.freeze if f not in FREEZABLE]
        if bad:
            p.append(f"freeze={list(self.freeze)} has unknown part(s) {bad}: use any of {', '.join(FREEZABLE)}")
        if len(set(self.freeze)) != len(self.freeze):
            p.append(f"freeze={list(self.freeze)} names a part twice")
        if set(FREEZABLE) <= set(self.freeze):
            p.append(f"freeze={list(self.freeze)} freezes every part: nothing would train")
        return p

    def _shape_problems(self) -> list[str]:
        p = []
        v = self.vision
        if self.pixel_shuffle:
            if self.vision_feature_select == "all" and v.class_token:
                p.append("pixel_shuffle=true needs a square grid of patch features, but vision_feature_select='all' "
                         "keeps the class token: use vision_feature_select='patches'")  # fmt: skip
            if v.grid_size % 2:
                p.append(f"pixel_shuffle=true needs an even patch grid, but the vision tower's grid is "
                         f"{v.grid_size} x {v.grid_size} (vision.image_size={v.image_size} // vision.patch_size="
                         f"{v.patch_size}); change the image or patch size, or set pixel_shuffle=false")  # fmt: skip
        if not p and self.image_tokens > self.language.max_position_embeddings:
            p.append(f"one image becomes {self.image_tokens} tokens, more than language.max_position_embeddings="
                     f"{self.language.max_position_embeddings}: raise it or use pixel_shuffle")  # fmt: skip
        return p


# a llama-style LM for tests (CPU, milliseconds): the tiny-clip tower's 16 patches become 16 tokens
_TINY_LM: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, activation="swiglu", normalization="rmsnorm",
                                add_bias_linear=False, position_embedding="rope", vocab_size=256,
                                make_vocab_size_divisible_by=64, max_position_embeddings=256,
                                share_embeddings_and_output_weights=False, norm_eps=1e-6)  # fmt: skip

LLAVA_PRESETS: dict[str, dict[str, Any]] = {
    # tests: tiny-clip (16 px, 4 px patches, features of layer -2) + a 2-layer llama-style LM; the last id of its
    # 256-token vocabulary is the image token
    "llava-tiny": dict(vision="tiny-clip", language=_TINY_LM, image_token_id=255, projector="mlp"),
    # the benchmark shape: CLIP ViT-L/14-336 (features of layer -2, 576 patch tokens) + llama-1b through LLaVA-1.5's
    # MLP projector; the image token is the last id of llama-1b's 32768-token vocabulary (override it to match the
    # tokenizer)
    "llava-1b-clip336": dict(vision="clip-vit-l14-336", language="llama-1b", image_token_id=32767, projector="mlp"),
}


def _part(value: Any, override: Any, base: Any, replace: Any) -> Any:
    """A sub-config: the preset's (a preset name or a field dict built by ``base``), then ``override`` (a config,
    or a dict of fields changed on top of the preset's)."""
    if isinstance(override, VisionConfig | TransformerConfig):
        return override
    config = base(value) if isinstance(value, str) else base(None, **value)
    return replace(config, **override) if override else config


def llava_preset(name: str, **overrides: Any) -> LlavaConfig:
    """A :class:`LlavaConfig` from :data:`LLAVA_PRESETS` (``_`` and ``-`` are interchangeable in the name).

    ``overrides`` set LlavaConfig fields; ``vision`` and ``language`` may be whole configs or dicts of the fields
    changed (``llava_preset("llava-tiny", language={"num_layers": 4})``).
    """
    key = name.replace("_", "-")
    if key not in LLAVA_PRESETS:
        raise KeyError(f"unknown LLaVA preset {name!r}; known: {', '.join(sorted(LLAVA_PRESETS))}")
    fields = dict(LLAVA_PRESETS[key])
    vision = _part(fields.pop("vision"), overrides.pop("vision", None), _vision_base, VisionConfig.replace)
    language = _part(fields.pop("language"), overrides.pop("language", None), _language_base,
                     TransformerConfig.replace)  # fmt: skip
    return LlavaConfig(vision=vision, language=language, **{**fields, **overrides})


def _vision_base(name: str | None, **fields: Any) -> VisionConfig:
    return vision_preset(name) if name is not None else VisionConfig(**fields)


def _language_base(name: str | None, **fields: Any) -> TransformerConfig:
    return preset(name) if name is not None else TransformerConfig(**fields)
