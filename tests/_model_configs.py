"""Tiny Llama-style and GPT-2-style configs shared by the model, export and inference tests."""

from __future__ import annotations

from typing import Any

from mcore_models import TransformerConfig


def llama(**kw: Any) -> TransformerConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        activation="swiglu",
        normalization="rmsnorm",
        add_bias_linear=False,
        position_embedding="rope",
        rotary_base=10000.0,
        vocab_size=100,
        max_position_embeddings=64,
        share_embeddings_and_output_weights=False,
        norm_eps=1e-6,
    )
    base.update(kw)
    return TransformerConfig(**base)


def gpt2(**kw: Any) -> TransformerConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        activation="gelu_tanh",
        normalization="layernorm",
        add_bias_linear=True,
        position_embedding="learned_absolute",
        vocab_size=100,
        max_position_embeddings=64,
        share_embeddings_and_output_weights=True,
    )
    base.update(kw)
    return TransformerConfig(**base)
