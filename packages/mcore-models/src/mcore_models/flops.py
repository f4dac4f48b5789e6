"""Parameter counts and model FLOPs from a config (the formulas ``docs/models.md`` writes down).

Model FLOPs follow Megatron-LM's formula with causal attention counted half: per token, for training (forward
plus backward, 3x the forward's 2 FLOPs per multiply-add),

    12 * L * h^2 * ((1 + g/n + s/(2h)) * (n*d/h) + (f/h) * m + V / (2*L*h))

with L layers, hidden h, n query heads, g key/value groups, head dim d, sequence s, MLP width f, m = 1.5 for gated
(SwiGLU) MLPs and 1 otherwise, and vocabulary V (the padded size, since the output layer computes it).

An MoE layer counts, as Megatron does, the MLPs a token actually passes through: ``(f_e * k + f_s) / h * m`` with
expert width f_e, top-k k and shared-expert width f_s (0 without), plus the router, ``E / (2h)`` for E experts.
"""

from __future__ import annotations

from mcore_models.config import TransformerConfig
from mcore_parallel.tensor import padded_vocab_size

__all__ = ["num_parameters", "training_flops_per_token"]


def num_parameters(config: TransformerConfig, *, tp_size: int = 1, include_padding: bool = True) -> int:
    """Total parameters of the model (all stages and TP ranks together; tied weights counted once)."""
    c = config
    h, d, n, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    norm = h * (2 if c.normalization == "layernorm" else 1)
    head_norm = d * (2 if c.normalization == "layernorm" else 1)
    bias = c.add_bias_linear
    qkv = h * (n + 2 * g) * d + (n + 2 * g) * d * int(c.qkv_bias)
    proj = n * d * h + h * int(bias)
    fc1_out = (2 if c.gated else 1) * f
    mlp = h * fc1_out + fc1_out * int(bias) + f * h + h * int(bias)
    qk = 2 * head_norm if c.qk_layernorm else 0
    per_layer = 2 * norm + qkv + proj + qk
    moe = c.moe
    layers = 0
    for i in range(c.num_layers):
        if moe is not None and moe.is_moe_layer(i):
            up = 2 if c.gated else 1
            fe, fs = moe.expert_ffn(f), moe.shared_expert_ffn_hidden_size or 0
            routed = moe.num_experts * (h + (up + 1) * fe * h)
            layers += per_layer + routed + (up + 1) * fs * h + (h if moe.shared_expert_gate else 0)
        else:
            layers += per_layer + mlp
    vocab = (
        padded_vocab_size(c.vocab_size, tp_size, c.make_vocab_size_divisible_by) if include_padding else c.vocab_size
    )
    embed = vocab * h
    positions = c.max_position_embeddings * h if c.position_embedding == "learned_absolute" else 0
    output = 0 if c.share_embeddings_and_output_weights else vocab * h
    return layers + norm + embed + positions + output


def training_flops_per_token(config: TransformerConfig, seq_length: int, *, tp_size: int = 1) -> float:
    """Model FLOPs per trained token (forward + backward), Megatron's formula, causal attention counted half."""
    c = config
    h, n, g, d, L = c.hidden_size, c.num_attention_heads, c.query_groups, c.head_dim, c.num_layers
    vocab = padded_vocab_size(c.vocab_size, tp_size, c.make_vocab_size_divisible_by)
    attn = (1 + g / n + seq_length / h * 0.5) * (n * d / h)
    m = 1.5 if c.gated else 1.0
    mlp = 0.0
    for i in range(L):
        if c.moe is not None and c.moe.is_moe_layer(i):
            shared = c.moe.shared_expert_ffn_hidden_size or 0
            mlp += (c.moe.expert_ffn(c.ffn_size) * c.moe.router_topk + shared) / h * m + c.moe.num_experts / (2 * h)
        else:
            mlp += c.ffn_size / h * m
    logits = vocab / (2 * L * h)
    return 12.0 * L * h * h * (attn + mlp / L + logits)
