"""Converters between :class:`~mcore_models.multimodal.LlavaModel` and Hugging Face
``LlavaForConditionalGeneration``: configs both ways, state dicts tensor by tensor (``get`` returns one tensor by key).

The three parts reuse the existing mappings: the vision tower is :mod:`mcore_models.hf_vision`'s (CLIP or SigLIP),
the language model :mod:`mcore_models.hf`'s Llama layout, and the projector maps one to one (mcore's
``projector.linear_fc1`` / ``linear_fc2`` are HF's ``multi_modal_projector.linear_1`` / ``linear_2``, with GELU
between them). Only the key prefixes differ between the two HF layouts (:data:`LLAVA_LAYOUTS`):

- ``hub``: what the Hub's LLaVA checkpoints hold (``llava-hf/llava-1.5-7b-hf``) and every transformers version (and
  vLLM) reads: ``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
  ``language_model.lm_head.weight``.
- ``module``: the transformers 5 module's own state dict: ``model.vision_tower.*``, ``model.multi_modal_projector.*``,
  ``model.language_model.*``, ``lm_head.weight``.

(transformers 5's ``save_pretrained`` writes a third mix, ``vision_tower.*`` without ``vision_model.``;
:func:`llava_hf_layout` finds the prefixes of any state dict from its keys.)

HF selects the vision features with ``vision_feature_layer`` (mcore's ``VisionConfig.vision_feature_layer``) and
``vision_feature_select_strategy``: ``default`` drops the first token (CLIP's class token: mcore's ``patches``),
``full`` keeps every token (``all``; a SigLIP tower has no class token, so its ``patches`` are HF's ``full``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore_models import hf as _hf
from mcore_models.errors import ConfigError, ConversionError
from mcore_models.hf_vision import (
    hf_vision_prefix,
    vision_config_from_hf,
    vision_config_to_hf,
    vision_hf_architecture,
    vision_hf_to_mcore,
    vision_mcore_to_hf,
)
from mcore_models.multimodal import LlavaConfig

__all__ = [
    "LLAVA_ARCHITECTURE",
    "LLAVA_LAYOUTS",
    "LlavaLayout",
    "llava_hf_problems",
    "llava_config_to_hf",
    "llava_config_from_hf",
    "llava_hf_layout",
    "llava_mcore_to_hf",
    "llava_hf_to_mcore",
]

Getter = Callable[[str], torch.Tensor]

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"

# transformers' defaults for fields a Hub config.json may leave out (LlavaConfig's CLIP tower, LlamaConfig,
# CLIPVisionConfig, SiglipVisionConfig): a sub-config dict is completed with them before it is read.
_LLAVA_VISION_DEFAULT = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                             num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14)  # fmt: skip
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        hidden_act="quick_gelu",
    ),
    "siglip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
    ),
}
_LLAMA_DEFAULTS = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6)  # fmt: skip
_SELECT_FROM_HF = {"default": "patches", "full": "all"}


@dataclass(frozen=True)
class LlavaLayout:
    """Where the parts of an HF LLaVA state dict live: the vision tower's prefix (as :mod:`hf_vision` takes it),
    the projector's, the language model's (in place of Llama's ``model.``) and the key of ``lm_head``."""

    vision: str
    projector: str
    language: str
    lm_head: str


LLAVA_LAYOUTS = {
    "hub": LlavaLayout(
        "vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.", "language_model.lm_head.weight"
    ),
    "module": LlavaLayout(
        "model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.weight"
    ),
}


# ---------------------------------------------------------------------------------------------------- configs
def llava_hf_problems(config: LlavaConfig) -> list[str]:
    """What ``LlavaForConditionalGeneration`` cannot represent in ``config`` (each naming its field); the vision
    tower and the language model are checked by their own converters."""
    p = []
    if config.projector != "mlp":
        p.append(f"projector={config.projector!r} (HF's multi_modal_projector is linear_1 -> gelu -> linear_2: mlp)")
    if config.pixel_shuffle:
        p.append("pixel_shuffle=True (HF LLaVA projects every patch feature; it has no pixel shuffle)")
    return p


def _check(config: LlavaConfig) -> None:
    problems = llava_hf_problems(config)
    if problems:
        raise ConversionError(f"{LLAVA_ARCHITECTURE} cannot represent: " + "; ".join(problems))
    try:
        vision_hf_architecture(config.vision)
    except ConversionError as e:
        raise ConversionError(f"{LLAVA_ARCHITECTURE} vision tower: {e}") from None
    try:
        arch = _hf.hf_architecture(config.language)
    except ConversionError as e:
        raise ConversionError(f"{LLAVA_ARCHITECTURE} language: {e}") from None
    if arch != "LlamaForCausalLM":
        raise ConversionError(f"{LLAVA_ARCHITECTURE} language: only a Llama language model is exported ({arch} is not)")


def _select_to_hf(config: LlavaConfig) -> str:
    return "default" if config.vision_feature_select == "patches" and config.vision.class_token else "full"


def llava_config_to_hf(config: LlavaConfig) -> dict[str, Any]:
    """The ``config.json`` of ``LlavaForConditionalGeneration`` for ``config`` (a ConversionError naming the field
    when HF cannot represent it)."""
    _check(config)
    vision = vision_config_to_hf(config.vision)
    text = _hf.llama_config_to_hf(config.language)
    for sub in (vision, text):
        sub.pop("architectures", None)
    return {
        "architectures": [LLAVA_ARCHITECTURE],
        "model_type": "llava",
        "vision_config": vision,
        "text_config": text,
        "image_token_index": config.image_token_id,
        "image_seq_length": config.image_tokens,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": _select_to_hf(config),
        "vision_feature_layer": config.vision.vision_feature_layer,
        "multimodal_projector_bias": config.projector_bias,
        "tie_word_embeddings": config.language.share_embeddings_and_output_weights,
    }


def _completed(sub: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    out.update({k: v for k, v in (sub or {}).items() if v is not None})
    return out


def _vision_dict(hf: dict[str, Any]) -> dict[str, Any]:
    sub = hf.get("vision_config")
    if sub is None:
        sub = _LLAVA_VISION_DEFAULT
    model_type = sub.get("model_type")
    if model_type not in _VISION_DEFAULTS:
        raise ConversionError(
            f"vision_config.model_type={model_type!r}: supported vision towers are {sorted(_VISION_DEFAULTS)}"
        )
    return _completed(sub, _VISION_DEFAULTS[model_type])


def _llava_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The LlavaConfig fields of the top level of an HF LLaVA config (refusing what mcore cannot build)."""
    act = hf.get("projector_hidden_act", "gelu")
    if act != "gelu":
        raise ConversionError(f"projector_hidden_act={act!r}: mcore's projector uses exact GELU (gelu)")
    select = hf.get("vision_feature_select_strategy", "default")
    if select not in _SELECT_FROM_HF:
        raise ConversionError(f"vision_feature_select_strategy={select!r} is not one of {sorted(_SELECT_FROM_HF)}")
    image_token = hf.get("image_token_index", hf.get("image_token_id"))
    return dict(
        image_token_id=32000 if image_token is None else image_token,
        projector="mlp",
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        pixel_shuffle=False,
        vision_feature_select=_SELECT_FROM_HF[select],
    )


def llava_config_from_hf(hf: dict[str, Any], *, params_dtype: str | None = None, **overrides: Any) -> LlavaConfig:
    """A LlavaConfig from an HF LLaVA ``config.json`` dict (fields it leaves out take transformers' defaults).
    ``params_dtype`` sets both parts' dtype; ``overrides`` set LlavaConfig fields. Errors are one-line
    ConversionErrors naming the field."""
    if hf.get("model_type", "llava") != "llava":
        raise ConversionError(f"model_type={hf.get('model_type')!r} is not llava")
    fields = _llava_fields_from_hf(hf)
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ConversionError(f"vision_feature_layer={layer!r}: mcore's tower selects one layer (an integer)")
    dtype = {} if params_dtype is None else {"params_dtype": params_dtype}
    vision_hf = _vision_dict(hf)
    if vision_hf["model_type"] == "siglip_vision_model" and fields["vision_feature_select"] == "patches":
        raise ConversionError(
            "vision_feature_select_strategy='default' with a SigLIP tower: HF drops the first patch (there is no "
            "class token to drop), which mcore's projector does not do; only 'full' is supported for SigLIP"
        )
    text_hf = _completed(hf.get("text_config"), _LLAMA_DEFAULTS)
    if text_hf.get("model_type") != "llama":
        raise ConversionError(f"text_config.model_type={text_hf.get('model_type')!r}: only llama is supported")
    # HF ties lm_head when the top level says so, which LlavaConfig also sets from the text config's
    text_hf["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings")) or bool(text_hf.get("tie_word_embeddings"))
    try:
        vision = vision_config_from_hf(vision_hf, vision_feature_layer=layer, **dtype)
        if not vision.class_token:  # every token is a patch: full is mcore's patches (the default; all is the same)
            fields["vision_feature_select"] = "patches"
        language = _hf.llama_config_from_hf(text_hf, **dtype)
        config = LlavaConfig(vision=vision, language=language, **{**fields, **overrides})
    except ConfigError as e:
        raise ConversionError(f"{e.args[0].splitlines()[0].rstrip(':')}: " + "; ".join(e.problems)) from None
    seq = hf.get("image_seq_length")
    if seq is not None and seq != config.image_tokens:
        raise ConversionError(
            f"image_seq_length={seq} but the vision tower gives {config.image_tokens} image tokens per image"
        )
    return config


# ------------------------------------------------------------------------------------------------ state dicts
def _one_prefix(keys: set[str], anchor: str) -> str:
    found = sorted({k[: -len(anchor)] for k in keys if k.endswith(anchor)})
    if len(found) != 1:
        raise ConversionError(f"expected one {anchor} in the LLaVA state dict, found prefixes {found}")
    return found[0]


def llava_hf_layout(keys: Iterable[str]) -> LlavaLayout:
    """The prefixes of an HF LLaVA state dict, found from its keys (any of the layouts above)."""
    keys = set(keys)
    language = _one_prefix(keys, "embed_tokens.weight")
    heads = [k for k in ("lm_head.weight", "language_model.lm_head.weight") if k in keys]
    default_head = "language_model.lm_head.weight" if language.startswith("language_model.") else "lm_head.weight"
    return LlavaLayout(
        vision=hf_vision_prefix(keys),
        projector=_one_prefix(keys, "linear_1.weight"),
        language=language,
        lm_head=heads[0] if heads else default_head,
    )


def _layout(layout: str | LlavaLayout) -> LlavaLayout:
    if isinstance(layout, LlavaLayout):
        return layout
    if layout not in LLAVA_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {sorted(LLAVA_LAYOUTS)}")
    return LLAVA_LAYOUTS[layout]


def _llama_key(key: str, lay: LlavaLayout) -> str:
    """A key of :mod:`mcore_models.hf`'s Llama layout (``model.*``, ``lm_head.weight``) inside the LLaVA layout."""
    if key == "lm_head.weight":
        return lay.lm_head
    assert key.startswith("model."), key
    return lay.language + key[len("model.") :]


def _projector_pairs(config: LlavaConfig, lay: LlavaLayout) -> list[tuple[str, str]]:
    params = ("weight", "bias") if config.projector_bias else ("weight",)
    return [(f"projector.linear_fc{i}.{p}", f"{lay.projector}linear_{i}.{p}") for i in (1, 2) for p in params]


def llava_mcore_to_hf(
    config: LlavaConfig, get: Getter, layout: str | LlavaLayout = "hub"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` for every tensor of ``LlavaForConditionalGeneration`` in ``layout`` (``hub``,
    ``module`` or a :class:`LlavaLayout`), reading LlavaModel's global tensors (``vision.*``, ``projector.*``,
    ``language.*``) via ``get``. A tied language model writes no ``lm_head``."""
    _check(config)
    lay = _layout(layout)
    yield from vision_mcore_to_hf(config.vision, lambda k: get(f"vision.{k}"), lay.vision)
    for mk, hk in _projector_pairs(config, lay):
        yield hk, get(mk)
    for key, tensor in _hf.mcore_to_hf(config.language, lambda k: get(f"language.{k}")):
        yield _llama_key(key, lay), tensor


def llava_hf_to_mcore(
    config: LlavaConfig, get: Getter, layout: str | LlavaLayout = "hub"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mcore_key, global tensor)`` for every LlavaModel parameter, reading HF tensors of ``layout``
    (``hub``, ``module``, or the :class:`LlavaLayout` :func:`llava_hf_layout` finds) via ``get``."""
    _check(config)
    lay = _layout(layout)
    for key, tensor in vision_hf_to_mcore(config.vision, get, lay.vision):
        yield f"vision.{key}", tensor
    for mk, hk in _projector_pairs(config, lay):
        yield mk, get(hk)
    for key, tensor in _hf.hf_to_mcore(config.language, lambda k: get(_llama_key(k, lay))):
        yield f"language.{key}", tensor
