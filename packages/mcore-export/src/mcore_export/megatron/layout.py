"""Megatron-Core's tensor names and layouts, and how they map onto mcore's.

mcore's names were chosen to be Megatron-Core's (``decoder.layers.3.self_attention.linear_qkv.weight``), and so were
its fused layouts: the QKV projection is Megatron's interleaved per-group layout (for each key/value group its query
heads, then its key, then its value) and SwiGLU's ``linear_fc1`` is ``[gate; up]`` over the whole (global) width. What
differs is only how Megatron stores them:

- ``torch_dist`` stacks the layers of a homogeneous model into one tensor with a leading layer axis
  (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[num_layers, ...]``; a model with mixed layers keeps
  ``decoder.layers.<i>.``), stacks experts along a second axis (``mlp.experts.experts.linear_fc1.weight``, or
  ``mlp.experts.local_experts...`` in older versions) and uses Transformer Engine's names for norms fused into the
  next linear layer (``self_attention.linear_qkv.layer_norm_weight`` is the input norm, ``mlp.linear_fc1.
  layer_norm_weight`` the pre-MLP norm), even for the local (non-TE) layers;
- the legacy ``model_optim_rng.pt`` files hold each rank's own pieces under local layer numbers (see
  :mod:`mcore_export.megatron.legacy`);
- the embedding and output layer have ``padded_vocab_size`` rows (mcore's global arrays have ``vocab_size``).

:func:`to_mcore_name` maps one per-layer Megatron name to mcore's, :func:`to_megatron_name` the reverse (the names
megatron-core's local and TE layer specs load); :func:`split_glu`/:func:`join_glu` handle the TP pieces of a fused
``[gate; up]`` weight.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "to_mcore_name",
    "to_megatron_name",
    "stacked_name",
    "is_vocab",
    "is_glu_fc1",
    "split_glu",
    "join_glu",
    "EXTRA_STATE_MODULES",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TO_MCORE = [  # (Megatron name inside a layer, mcore's)
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate.weight"),
]
_EXPERT_PREFIXES = ("mlp.experts.experts.", "mlp.experts.local_experts.")
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
)
"""Linear layers whose ``_extra_state`` (Transformer Engine's FP8 metadata; empty for local layers) a megatron-core
model asks a checkpoint for; experts' are ``mlp.experts.experts.linear_fc{1,2}``."""


def to_mcore_name(inner: str) -> str | None:
    """mcore's name for a name inside a layer (``decoder.layers.<i>.`` removed), None for ``_extra_state``."""
    if inner.endswith("_extra_state"):
        return None
    for megatron, mcore in _TO_MCORE:
        if inner == megatron:
            return mcore
    for prefix in _EXPERT_PREFIXES:
        if inner.startswith(prefix):
            return "mlp.experts." + inner[len(prefix) :]
    return inner


def to_megatron_name(inner: str) -> str:
    """The name megatron-core's local GPT layer spec (and Transformer Engine's, for dense layers) gives mcore's
    ``inner`` (a name inside a layer) in a ``torch_dist`` checkpoint: the pre-MLP norm is always
    ``mlp.linear_fc1.layer_norm_weight`` (Transformer Engine's MoE layers call it ``pre_mlp_layernorm.weight``)."""
    for megatron, mcore in _TO_MCORE:
        if inner == mcore:
            return megatron
    if inner.startswith("mlp.experts."):
        return "mlp.experts.experts." + inner[len("mlp.experts.") :]
    return inner


def stacked_name(key: str) -> tuple[str, int] | None:
    """``decoder.layers.<i>.<inner>`` -> (``<inner>``, i); None for a name outside the layers."""
    m = _LAYER.match(key)
    return (m.group(2), int(m.group(1))) if m else None


def is_vocab(key: str) -> bool:
    """Whether the tensor has one row per (padded) vocabulary entry."""
    return key in ("embedding.word_embeddings.weight", "output_layer.weight")


def is_glu_fc1(inner: str, gated: bool) -> bool:
    """Whether ``inner`` (mcore's name inside a layer) is a ``[gate; up]`` fused first MLP projection."""
    return gated and (inner.endswith("linear_fc1.weight") or inner.endswith("linear_fc1.bias"))


def split_glu(t: torch.Tensor, parts: int, dim: int = 0) -> list[torch.Tensor]:
    """The TP pieces of a global ``[gate; up]`` tensor: piece r is ``[gate_r; up_r]`` (Megatron's, and mcore's)."""
    gate, up = t.chunk(2, dim=dim)
    return [torch.cat([g, u], dim=dim) for g, u in zip(gate.chunk(parts, dim=dim), up.chunk(parts, dim=dim))]


def join_glu(pieces: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`split_glu`."""
    halves = [p.chunk(2, dim=dim) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
