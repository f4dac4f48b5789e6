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

_LLAMA_1B_BODY = dict(
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
)

# Mamba-2 language models (state-spaces/mamba2-*: GPT-NeoX vocabulary, tied embeddings, no position embedding);
# num_attention_heads is unused without attention layers
_MAMBA2 = dict(
    normalization="rmsnorm",
    position_embedding="none",
    add_bias_linear=False,
    share_embeddings_and_output_weights=True,
    vocab_size=50277,
    max_position_embeddings=4096,
    norm_eps=1e-5,
    mamba=dict(d_state=128, d_conv=4, expand=2, head_dim=64, n_groups=1, chunk_size=256),
)
# llama-1b's width and parameter count (0.99 B outside the embeddings against 0.97 B) as a Nemotron-H-style hybrid:
# 32 layers, 14 Mamba-2 and 2 attention (RoPE as llama-1b; M : * = 7 : 1), each followed by a SwiGLU MLP of 6144
_HYBRID_1B_PATTERN = ("M-" * 3 + "*-" + "M-" * 4) * 2

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-350m": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "llama-1b": _LLAMA_1B_BODY,
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
    "moe-tiny": dict(
        _LLAMA,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=256,
        make_vocab_size_divisible_by=64,
        max_position_embeddings=256,
        moe=dict(num_experts=8, ffn_hidden_size=64, router_topk=2, aux_loss_coeff=1e-2),
    ),
    # llama-1b's attention and active MLP FLOPs (2 x 4096 = 8192) over 8 experts: 3.5 B parameters
    "moe-8x4k": dict(
        _LLAMA_1B_BODY,
        moe=dict(num_experts=8, ffn_hidden_size=4096, router_topk=2, aux_loss_coeff=1e-2),
    ),
    # the same active FLOPs as 8 of 32 narrow experts (8 x 1024 = 8192)
    "moe-32x1k": dict(
        _LLAMA_1B_BODY,
        moe=dict(num_experts=32, ffn_hidden_size=1024, router_topk=8, aux_loss_coeff=1e-2),
    ),
    "mixtral-8x7b": dict(
        _LLAMA,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        rotary_base=1000000.0,
        share_embeddings_and_output_weights=False,
        moe=dict(num_experts=8, router_topk=2, aux_loss_coeff=0.02),
    ),
    "qwen3-moe-30b-a3b": dict(
        _LLAMA,
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        qk_layernorm=True,
        ffn_hidden_size=6144,
        norm_eps=1e-6,
        vocab_size=151936,
        max_position_embeddings=40960,
        rotary_base=1000000.0,
        share_embeddings_and_output_weights=False,
        moe=dict(num_experts=128, ffn_hidden_size=768, router_topk=8, aux_loss_coeff=1e-3),
    ),
    # DeepSeek-V3's sizes and routing (sigmoid scores, 8 groups of which 4 eligible, a shared expert, aux-loss-free
    # balancing with a small sequence-level loss, 3 dense layers first). Its multi-head latent attention is not
    # modelled: the attention here is standard multi-head attention with the same head count and head width.
    "deepseek-v3": dict(
        _LLAMA,
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        kv_channels=128,
        ffn_hidden_size=18432,
        norm_eps=1e-6,
        vocab_size=129280,
        max_position_embeddings=163840,
        share_embeddings_and_output_weights=False,
        moe=dict(
            num_experts=256,
            ffn_hidden_size=2048,
            router_topk=8,
            layer_freq=[0] * 3 + [1] * 58,
            router_score_function="sigmoid",
            router_num_groups=8,
            router_group_topk=4,
            router_topk_scaling_factor=2.5,
            router_enable_expert_bias=True,
            load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-4,
            shared_expert_ffn_hidden_size=2048,
        ),
    ),
    "mamba2-130m": dict(_MAMBA2, num_layers=24, hidden_size=768, num_attention_heads=12, hybrid_pattern="M" * 24),
    "mamba2-1.3b": dict(_MAMBA2, num_layers=48, hidden_size=2048, num_attention_heads=32, hybrid_pattern="M" * 48),
    "hybrid-1b": dict(
        _LLAMA_1B_BODY,
        num_layers=len(_HYBRID_1B_PATTERN),
        ffn_hidden_size=6144,
        hybrid_pattern=_HYBRID_1B_PATTERN,
        mamba=dict(d_state=128, d_conv=4, expand=2, head_dim=64, n_groups=1, chunk_size=256),
    ),
    # Nemotron-H-8B's sizes and layer pattern (24 Mamba-2, 4 attention without position embedding, 24 squared-ReLU
    # MLPs); its tokenizer and FP8 recipe are not part of a preset
    "nemotron-h-8b": dict(
        normalization="rmsnorm",
        position_embedding="none",
        add_bias_linear=False,
        activation="squared_relu",
        num_layers=52,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=21504,
        vocab_size=131072,
        max_position_embeddings=8192,
        norm_eps=1e-5,
        share_embeddings_and_output_weights=False,
        hybrid_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba=dict(d_state=128, d_conv=4, expand=2, head_dim=64, n_groups=8, chunk_size=128),
    ),
    # for tests: every layer kind but MoE, two B/C groups, a chunk shorter than the test sequences
    "hybrid-tiny": dict(
        _LLAMA,
        num_layers=5,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=256,
        make_vocab_size_divisible_by=64,
        max_position_embeddings=256,
        hybrid_pattern="M*-M-",
        mamba=dict(d_state=16, d_conv=4, expand=2, head_dim=16, n_groups=2, chunk_size=8),
    ),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """The named architecture, with any field overridden (e.g. ``params_dtype="bfloat16"``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    fields = dict(PRESETS[name], **overrides)
    if isinstance(overrides.get("mamba"), dict):  # a partial mamba override keeps the rest
        fields["mamba"] = dict(PRESETS[name].get("mamba") or {}, **overrides["mamba"])
    if isinstance(overrides.get("moe"), dict):
        fields["moe"] = dict(
            PRESETS[name].get("moe") or {}, **overrides["moe"]
        )  # a partial moe override keeps the rest
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    extra = {"preset": name, **(fields.pop("extra", None) or {})}
    return TransformerConfig(**fields, extra=extra)
