"""Converters between :class:`~mcore_models.vision.VisionEncoder` and Hugging Face ``CLIPVisionModel`` /
``SiglipVisionModel`` towers: configs both ways, state dicts tensor by tensor (``get`` returns one tensor by key).

Layouts handled here:
- HF has separate ``q_proj`` / ``k_proj`` / ``v_proj`` (weights and biases); mcore's ``linear_qkv`` is fused in the
  grouped layout of :mod:`mcore_models.hf` (per head: its query, key and value rows), split and fused with the same
  helpers as Llama's.
- HF's ``layer_norm1`` / ``layer_norm2`` are the layer's ``input_layernorm`` / ``pre_mlp_layernorm``; ``out_proj``,
  ``fc1``, ``fc2`` are ``linear_proj``, ``linear_fc1``, ``linear_fc2``.
- CLIP's ``class_embedding``, ``pre_layrnorm`` (sic) and ``post_layernorm`` (applied by HF to the pooled class token
  only); SigLIP's patch-convolution bias and ``post_layernorm`` (on every token of ``last_hidden_state``).
- SigLIP's attention-pooling ``head`` is not part of the encoder (VLMs use the patch features): its tensors are
  ignored on import, and the exported config sets ``vision_use_head=False``.

HF keys carry a prefix depending on the module that holds the tower (``""`` for ``CLIPVisionModel`` in
transformers 5, ``vision_model.`` in a ``CLIPModel`` checkpoint, ``model.vision_tower.vision_model.`` in LLaVA):
:func:`hf_vision_prefix` finds it from the keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mcore_models.errors import ConversionError
from mcore_models.hf import _fuse_qkv, _split_qkv
from mcore_models.vision.config import VisionConfig

__all__ = [
    "vision_hf_architecture",
    "vision_config_from_hf",
    "vision_config_to_hf",
    "vision_hf_to_mcore",
    "vision_mcore_to_hf",
    "hf_vision_prefix",
]

Getter = Callable[[str], torch.Tensor]

_ACTS_FROM_HF = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_ACTS_TO_HF = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_MODEL_TYPES = {"clip_vision_model": "CLIPVisionModel", "siglip_vision_model": "SiglipVisionModel"}


# ---------------------------------------------------------------------------------------------------- configs
def vision_hf_architecture(config: VisionConfig) -> str:
    """``CLIPVisionModel`` or ``SiglipVisionModel``, or a ConversionError naming what neither can represent."""
    c = config
    if c.class_token:
        problems = []
        if not c.pre_layernorm:
            problems.append("pre_layernorm=False (CLIP has pre_layrnorm)")
        if c.patch_bias:
            problems.append("patch_bias=True (CLIP's patch convolution has no bias)")
        if c.post_layernorm != "class_token":
            problems.append(f"post_layernorm={c.post_layernorm!r} (CLIP's is on the pooled class token: class_token)")
        if problems:
            raise ConversionError("CLIPVisionModel cannot represent: " + "; ".join(problems))
        return "CLIPVisionModel"
    problems = []
    if c.pre_layernorm:
        problems.append("pre_layernorm=True (SigLIP has none)")
    if not c.patch_bias:
        problems.append("patch_bias=False (SigLIP's patch convolution has a bias)")
    if c.post_layernorm != "tokens":
        problems.append(f"post_layernorm={c.post_layernorm!r} (SigLIP's is on every token: tokens)")
    if problems:
        raise ConversionError("SiglipVisionModel (no class token) cannot represent: " + "; ".join(problems))
    return "SiglipVisionModel"


def vision_config_from_hf(hf: dict[str, Any], **overrides: Any) -> VisionConfig:
    """A VisionConfig from a ``CLIPVisionConfig`` / ``SiglipVisionConfig`` dict (or a ``CLIPConfig`` /
    ``SiglipConfig`` / LLaVA dict holding one under ``vision_config``). ``overrides`` set other fields, e.g.
    ``vision_feature_layer=-2``."""
    if "vision_config" in hf and isinstance(hf["vision_config"], dict):
        hf = hf["vision_config"]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConversionError(f"model_type={model_type!r}: supported vision towers are {sorted(_MODEL_TYPES)}")
    act = hf.get("hidden_act")
    if act not in _ACTS_FROM_HF:
        raise ConversionError(f"hidden_act={act!r} is not supported; use one of {sorted(_ACTS_FROM_HF)}")
    clip = model_type == "clip_vision_model"
    fields: dict[str, Any] = dict(
        image_size=hf["image_size"],
        patch_size=hf["patch_size"],
        num_channels=hf.get("num_channels", 3),
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        activation=_ACTS_FROM_HF[act],
        norm_eps=hf.get("layer_norm_eps", 1e-5 if clip else 1e-6),
        class_token=clip,
        patch_bias=not clip,
        pre_layernorm=clip,
        post_layernorm="class_token" if clip else "tokens",
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        extra={"hf_architecture": _MODEL_TYPES[model_type]},
    )
    fields.update(overrides)
    return VisionConfig(**fields)


def vision_config_to_hf(config: VisionConfig) -> dict[str, Any]:
    """The ``CLIPVisionConfig`` / ``SiglipVisionConfig`` fields of ``config`` (a ConversionError when neither
    class can represent it)."""
    arch = vision_hf_architecture(config)
    c = config
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": "clip_vision_model" if arch == "CLIPVisionModel" else "siglip_vision_model",
        "image_size": c.image_size,
        "patch_size": c.patch_size,
        "num_channels": c.num_channels,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.ffn_size,
        "hidden_act": _ACTS_TO_HF[c.activation],
        "layer_norm_eps": c.norm_eps,
        "attention_dropout": c.attention_dropout,
    }
    if arch == "CLIPVisionModel":
        out["initializer_range"] = c.init_method_std
    else:
        out["vision_use_head"] = False
    return out


def hf_vision_prefix(keys: Iterable[str]) -> str:
    """The prefix of an HF vision tower's keys (what comes before ``embeddings.patch_embedding.weight``)."""
    anchor = "embeddings.patch_embedding.weight"
    found = sorted({k[: -len(anchor)] for k in keys if k.endswith(anchor)})
    if len(found) != 1:
        raise ConversionError(f"expected one vision tower ({anchor}) in the state dict, found prefixes {found}")
    return found[0]


# ---------------------------------------------------------------------------------------------- state dicts
def _pairs(c: VisionConfig, prefix: str) -> list[tuple[str, str]]:
    """``(mcore key, HF key)`` of every tensor that converts one to one (everything but q/k/v)."""
    e = f"{prefix}embeddings"
    out = [("embeddings.patch.weight", f"{e}.patch_embedding.weight")]
    if c.patch_bias:
        out.append(("embeddings.patch.bias", f"{e}.patch_embedding.bias"))
    if c.class_token:
        out.append(("embeddings.class_token", f"{e}.class_embedding"))
    out.append(("embeddings.position_embeddings.weight", f"{e}.position_embedding.weight"))
    if c.pre_layernorm:
        out += [(f"pre_layernorm.{p}", f"{prefix}pre_layrnorm.{p}") for p in ("weight", "bias")]
    for i in range(c.num_layers):
        m, h = f"decoder.layers.{i}", f"{prefix}encoder.layers.{i}"
        for mk, hk in (
            ("input_layernorm", "layer_norm1"),
            ("pre_mlp_layernorm", "layer_norm2"),
            ("self_attention.linear_proj", "self_attn.out_proj"),
            ("mlp.linear_fc1", "mlp.fc1"),
            ("mlp.linear_fc2", "mlp.fc2"),
        ):
            out += [(f"{m}.{mk}.{p}", f"{h}.{hk}.{p}") for p in ("weight", "bias")]
    if c.post_layernorm != "none":
        out += [(f"post_layernorm.{p}", f"{prefix}post_layernorm.{p}") for p in ("weight", "bias")]
    return out


def vision_hf_to_mcore(config: VisionConfig, get: Getter, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mcore_key, global tensor)`` for every encoder parameter, reading HF tensors (``prefix`` + key)."""
    vision_hf_architecture(config)
    tc = config.transformer_config()
    for mk, hk in _pairs(config, prefix):
        yield mk, get(hk)
    for i in range(config.num_layers):
        h = f"{prefix}encoder.layers.{i}.self_attn"
        for p in ("weight", "bias"):
            q, k, v = (get(f"{h}.{n}_proj.{p}") for n in "qkv")
            yield f"decoder.layers.{i}.self_attention.linear_qkv.{p}", _fuse_qkv(q, k, v, tc).contiguous()


def vision_mcore_to_hf(config: VisionConfig, get: Getter, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` (with ``prefix``) for every tensor of the HF tower, reading mcore global tensors
    via ``get``."""
    vision_hf_architecture(config)
    tc = config.transformer_config()
    for mk, hk in _pairs(config, prefix):
        yield hk, get(mk)
    for i in range(config.num_layers):
        h = f"{prefix}encoder.layers.{i}.self_attn"
        for p in ("weight", "bias"):
            q, k, v = _split_qkv(get(f"decoder.layers.{i}.self_attention.linear_qkv.{p}"), tc)
            yield f"{h}.q_proj.{p}", q.contiguous()
            yield f"{h}.k_proj.{p}", k.contiguous()
            yield f"{h}.v_proj.{p}", v.contiguous()
