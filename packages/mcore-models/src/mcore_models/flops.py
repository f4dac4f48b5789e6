"""Parameter counts and model FLOPs from a config (the formulas ``docs/models.md`` writes down).

Model FLOPs follow Megatron-LM's formula with causal attention counted half: per token, for training (forward
plus backward, 3x the forward's 2 FLOPs per multiply-add),

    12 * L * h^2 * ((1 + g/n + s/(2h)) * (n*d/h) + (f/h) * m + V / (2*L*h))

with L layers, hidden h, n query heads, g key/value groups, head dim d, sequence s, MLP width f, m = 1.5 for gated
(SwiGLU) MLPs and 1 otherwise, and vocabulary V (the padded size, since the output layer computes it).

An MoE layer counts, as Megatron does, the MLPs a token actually passes through: ``(f_e * k + f_s) / h * m`` with
expert width f_e, top-k k and shared-expert width f_s (0 without), plus the router, ``E / (2h)`` for E experts.

A hybrid model (``hybrid_pattern``) counts each layer by its kind: an attention layer (``*``) the attention term
above, an MLP (``-``) or MoE (``E``) layer the MLP term, and a Mamba-2 layer (``M``) as Megatron-LM counts it,
forward ``2 h (2 d_i + 2 G N + H) + 7 d_i N + 2 d_i h`` per token (the input projection to z, x, B, C and dt, the
scan, the output projection; d_i = expand * h inner width, G groups of state size N, H heads), times 3 for training.

A LLaVA step (:func:`llava_training_flops`) adds, per image, the vision tower up to ``vision_feature_layer`` (the
layers it runs) and the projector. A tower layer over T tokens costs forward ``2 T (4 h^2 + 2 h f) + 4 T^2 h``
(bidirectional attention, counted in full), the patch convolution ``2 P C p^2 h`` for P patches of C channels and
side p, and the projector ``2 T_img (h_in H + H^2)`` (the second term for ``mlp``) for T_img image tokens of the
LM's width H. Frozen parts do less than 3x their forward: each part counts its forward, plus one forward's worth for
the activation gradients when it or a part before it trains, plus one for its weight gradients when it trains (a
frozen tower runs forward only; a frozen LM under a trained projector runs forward and the activation gradients).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_models.config import TransformerConfig
from mcore_models.mamba_config import MambaConfig
from mcore_parallel.tensor import padded_vocab_size

if TYPE_CHECKING:
    from mcore_models.multimodal.config import LlavaConfig
    from mcore_models.vision.config import VisionConfig

__all__ = [
    "num_parameters",
    "training_flops_per_token",
    "vision_forward_flops",
    "projector_forward_flops",
    "llava_training_flops",
]


def num_parameters(config: TransformerConfig, *, tp_size: int = 1, include_padding: bool = True) -> int:
    """Total parameters of the model (all stages and TP ranks together; tied weights counted once)."""
    c = config
    h = c.hidden_size
    norm = h * (2 if c.normalization == "layernorm" else 1)
    layers = 0
    for kind in _kinds(c):
        if kind in "*AB":
            layers += norm + _attention_parameters(c)
        if kind in "-EAB":
            layers += norm + _mlp_parameters(c, kind in "EB")
        if kind == "M":
            layers += norm + _mamba_parameters(c)
    vocab = (
        padded_vocab_size(c.vocab_size, tp_size, c.make_vocab_size_divisible_by) if include_padding else c.vocab_size
    )
    embed = vocab * h
    positions = c.max_position_embeddings * h if c.position_embedding == "learned_absolute" else 0
    output = 0 if c.share_embeddings_and_output_weights else vocab * h
    return layers + norm + embed + positions + output


def _attention_parameters(c: TransformerConfig) -> int:
    h, d, n, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups
    qkv = h * (n + 2 * g) * d + (n + 2 * g) * d * int(c.qkv_bias)
    proj = n * d * h + h * int(c.add_bias_linear)
    qk = 2 * d * (2 if c.normalization == "layernorm" else 1) if c.qk_layernorm else 0
    return qkv + proj + qk


def _mlp_parameters(c: TransformerConfig, moe: bool) -> int:
    h, f, bias = c.hidden_size, c.ffn_size, c.add_bias_linear
    up = 2 if c.gated else 1
    if moe and c.moe is not None:
        fe, fs = c.moe.expert_ffn(f), c.moe.shared_expert_ffn_hidden_size or 0
        routed = c.moe.num_experts * (h + (up + 1) * fe * h)
        return routed + (up + 1) * fs * h + (h if c.moe.shared_expert_gate else 0)
    return h * up * f + up * f * int(bias) + f * h + h * int(bias)


def _mamba_sizes(c: TransformerConfig) -> tuple[MambaConfig, int, int, int, int]:
    """``(mamba, h, d_inner, heads, G * N)`` of a model with Mamba layers."""
    mc = c.mamba
    if mc is None:
        raise ValueError("a Mamba layer (M in hybrid_pattern) needs TransformerConfig.mamba")
    h = c.hidden_size
    return mc, h, mc.d_inner(h), mc.nheads(h), mc.n_groups * mc.d_state


def _mamba_parameters(c: TransformerConfig) -> int:
    mc, h, di, heads, gn = _mamba_sizes(c)
    conv_channels = di + 2 * gn
    conv = conv_channels * mc.d_conv + (conv_channels if mc.conv_bias else 0)
    # in_proj, conv1d, dt_bias + A_log + D, the gated norm, out_proj
    return h * (2 * di + 2 * gn + heads) + conv + 3 * heads + di + di * h


def training_flops_per_token(config: TransformerConfig, seq_length: int, *, tp_size: int = 1) -> float:
    """Model FLOPs per trained token (forward + backward), Megatron's formula, causal attention counted half."""
    c = config
    h = c.hidden_size
    vocab = padded_vocab_size(c.vocab_size, tp_size, c.make_vocab_size_divisible_by)
    total = 6.0 * h * vocab  # the output layer
    for kind in _kinds(c):
        if kind in "*AB":
            total += _attention_flops(c, seq_length)
        if kind in "-EAB":
            total += _mlp_flops(c, kind in "EB")
        if kind == "M":
            total += _mamba_flops(c)
    return total


def _kinds(c: TransformerConfig) -> list[str]:
    """Each layer's kind: the hybrid pattern's characters, or for a GPT model ``A`` (a Transformer layer: attention
    and MLP) and ``B`` (attention and MoE)."""
    if c.hybrid_pattern is not None:
        return list(c.hybrid_pattern.replace("|", ""))
    return ["B" if c.moe is not None and c.moe.is_moe_layer(i) else "A" for i in range(c.num_layers)]


def _attention_flops(c: TransformerConfig, seq_length: int) -> float:
    h, n, g, d = c.hidden_size, c.num_attention_heads, c.query_groups, c.head_dim
    return 12.0 * h * h * (1 + g / n + seq_length / h * 0.5) * (n * d / h)


def _mlp_flops(c: TransformerConfig, moe: bool) -> float:
    h, m = c.hidden_size, (1.5 if c.gated else 1.0)
    if moe and c.moe is not None:
        shared = c.moe.shared_expert_ffn_hidden_size or 0
        return 12.0 * h * h * ((c.moe.expert_ffn(c.ffn_size) * c.moe.router_topk + shared) / h * m
                               + c.moe.num_experts / (2 * h))  # fmt: skip
    return 12.0 * h * h * (c.ffn_size / h * m)


def _mamba_flops(c: TransformerConfig) -> float:
    mc, h, di, heads, gn = _mamba_sizes(c)
    return 3.0 * (2 * h * (2 * di + 2 * gn + heads) + 7 * di * mc.d_state + 2 * di * h)


def vision_forward_flops(config: VisionConfig) -> float:
    """Forward FLOPs of one image through the tower up to ``vision_feature_layer`` (the layers it runs)."""
    v = config
    t, h, f = v.seq_length, v.hidden_size, v.ffn_size
    patch = 2.0 * v.num_patches * v.num_channels * v.patch_size**2 * h
    layer = 2.0 * t * (4 * h * h + 2 * h * f) + 4.0 * t * t * h
    return patch + v.feature_layers * layer


def projector_forward_flops(config: LlavaConfig) -> float:
    """Forward FLOPs of the projector for one image."""
    hidden = config.language.hidden_size
    per_token = 2.0 * config.projector_input_size * hidden + (2.0 * hidden * hidden if config.projector == "mlp" else 0)
    return config.image_tokens * per_token


def llava_training_flops(
    config: LlavaConfig, *, batch_size: int, seq_length: int, num_images: int | None = None, tp_size: int = 1
) -> float:
    """Model FLOPs of one LLaVA training step (forward + backward) over ``batch_size`` sequences of ``seq_length``
    tokens (the image tokens included) holding ``num_images`` images (default: one per sequence); the LM as
    :func:`training_flops_per_token` counts it. Divide by the step time and the peak FLOP/s for MFU."""
    images = batch_size if num_images is None else num_images
    trains = [part not in config.freeze for part in ("vision", "projector", "language")]

    def passes(i: int) -> int:  # forward, activation gradients, weight gradients
        return 1 + int(any(trains[: i + 1])) + int(trains[i])

    lm_forward = batch_size * seq_length * training_flops_per_token(config.language, seq_length, tp_size=tp_size) / 3
    return (
        images * vision_forward_flops(config.vision) * passes(0)
        + images * projector_forward_flops(config) * passes(1)
        + lm_forward * passes(2)
    )
