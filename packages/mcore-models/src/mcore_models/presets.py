"""Named architecture presets (sizes only; training settings live in mcore-train recipes)."""

from __future__ import annotations

from typing import Any

from mcore_models.config import RopeScaling, TransformerConfig

__all__ = ["PRESETS", "preset"]

_GPT2 = dict(
    activation="gelu_tanh",
    normalization="layernorm",
    position_embedding="learned_absolute",
    add_bias_linear=True,
    share_embeddings_and_output_weights=True,
    vocab_size=50257,
    max_position_embeddings=1024,
    norm_eps=1e-5,
)
_LLAMA = dict(
    activation="swiglu",
    normalization="rmsnorm",
    position_embedding="rope",
    add_bias_linear=False,
    norm_eps=1e-5,
)

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-350m": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "llama-1b": dict(
        _LLAMA,
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=32768,
        max_position_embeddings=4096,
        rotary_base=500000.0,
        share_embeddings_and_output_weights=False,
    ),
    "llama3-8b": dict(
        _LLAMA,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rotary_base=500000.0,
        share_embeddings_and_output_weights=False,
    ),
    "llama3-70b": dict(
        _LLAMA,
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        rotary_base=500000.0,
        share_embeddings_and_output_weights=False,
    ),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """The named architecture, with any field overridden (e.g. ``params_dtype="bfloat16"``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    fields = dict(PRESETS[name], **overrides)
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    extra = {"preset": name, **(fields.pop("extra", None) or {})}
    return TransformerConfig(**fields, extra=extra)
