"""Hybrid models: a layer sequence from a pattern string, as Megatron-LM's hybrid models write it.

``TransformerConfig.hybrid_pattern`` holds one character per layer: ``M`` a Mamba-2 layer (norm + mixer), ``*`` an
attention layer (norm + self-attention), ``-`` an MLP layer (norm + MLP), ``E`` an MoE layer (norm + routed experts);
``|`` marks a pipeline-stage boundary and is not a layer (``"M-M*-|M-M*-"``: two stages of five layers). A
Transformer layer of a GPT model is the pair ``*-``.

The model is :class:`~mcore_models.gpt.GPTModel` itself, built with :func:`hybrid_spec` (``GPTModel`` picks it when the
config has a pattern): the embedding, final norm, output layer, loss, the training loop, checkpoints and export are
the GPT model's. Parameter names follow the standard layer's, so a GPT checkpoint's attention and MLP weights map to
the pattern's ``*-`` pairs (:func:`gpt_layer_names`): ``decoder.layers.{i}.input_layernorm`` /
``self_attention.*`` on an attention layer, ``decoder.layers.{i}.pre_mlp_layernorm`` / ``mlp.*`` on an MLP layer,
``decoder.layers.{i}.input_layernorm`` / ``mixer.*`` on a Mamba layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.layer import dropout_add, norm_mlp
from mcore_models.transformer.packed import DocumentMask, mask_kwargs

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec
    from mcore_models.transformer.attention import InferenceContext

__all__ = [
    "LAYER_KINDS",
    "AttentionLayer",
    "MLPLayer",
    "gpt_layer_names",
    "hybrid_layer",
    "hybrid_spec",
    "layer_kinds",
    "pattern_stage_counts",
    "stage_layers",
]

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""Pattern character -> layer kind."""
STAGE_BOUNDARY = "|"


def layer_kinds(pattern: str) -> str:
    """The pattern's layer characters (``|`` removed); a character that is none of ``M*-E|`` is a ``ValueError``."""
    bad = sorted({ch for ch in pattern if ch not in LAYER_KINDS and ch != STAGE_BOUNDARY})
    if bad:
        raise ValueError(
            f"hybrid_pattern={pattern!r} holds {bad}: use M (Mamba), * (attention), - (MLP), E (MoE) and | (a "
            "pipeline-stage boundary)"
        )
    return pattern.replace(STAGE_BOUNDARY, "")


def pattern_stage_counts(pattern: str, stages: int) -> list[int] | None:
    """Layers per pipeline stage (model chunk, with virtual stages) from the pattern's ``|`` boundaries (None when it
    has none: the usual even split applies); a pattern whose segments do not number ``stages``, or with an empty
    segment, is a ``ValueError``."""
    if STAGE_BOUNDARY not in pattern:
        return None
    segments = pattern.split(STAGE_BOUNDARY)
    if len(segments) != stages:
        raise ValueError(
            f"hybrid_pattern={pattern!r} has {len(segments)} pipeline stages (segments between '|'), but the layout "
            f"has {stages} (pp x vpp): give it {stages - 1} '|' boundaries, or none for an even split"
        )
    counts = [len(layer_kinds(s)) for s in segments]
    if 0 in counts:
        raise ValueError(f"hybrid_pattern={pattern!r}: stage {counts.index(0)} holds no layer")
    return counts


def stage_layers(
    config: TransformerConfig,
    pp_size: int,
    pp_rank: int,
    vpp_size: int = 1,
    vpp_rank: int = 0,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> range:
    """The global layers of chunk ``vpp_rank`` of pipeline rank ``pp_rank``: the pattern's ``|`` segments when it
    has them (chunk ``v`` of rank ``p`` holds segment ``v * pp + p``, as the interleaved schedule visits them),
    otherwise :func:`~mcore_parallel.pipeline.stage_layer_range`'s split."""
    from mcore_parallel.pipeline import stage_layer_range

    pattern = config.hybrid_pattern
    if pattern is None or STAGE_BOUNDARY not in pattern:
        return stage_layer_range(config.num_layers, pp_size, pp_rank, vpp_size, vpp_rank, first_stage_layers,
                                 last_stage_layers)  # fmt: skip
    if first_stage_layers is not None or last_stage_layers is not None:
        raise ValueError(
            "first_stage_layers / last_stage_layers are set, but hybrid_pattern's '|' boundaries place the layers: "
            "drop one of them"
        )
    counts = pattern_stage_counts(pattern, pp_size * vpp_size)
    assert counts is not None
    block = vpp_rank * pp_size + pp_rank
    start = sum(counts[:block])
    return range(start, start + counts[block])


class _Residual(nn.Module):
    """Half of a Transformer layer: ``x + dropout(part(norm(x)))``, the layer kinds hybrid models are made of."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, layer_number: int) -> None:
        super().__init__()
        self.layer_number, self.ctx = layer_number, ctx
        self.hidden_dropout = config.hidden_dropout


class AttentionLayer(_Residual):
    """``*``: ``x + attn(input_layernorm(x))``, the attention half of a Transformer layer (its parameter names)."""

    def __init__(
        self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, layer_number: int, prefix: str
    ) -> None:
        super().__init__(config, ctx, layer_number)
        self.input_layernorm = spec.norm(config, config.hidden_size, ctx.device, ctx.sequence_parallel)
        self.self_attention = spec.attention(
            config, ctx, spec, f"{prefix}.self_attention", selective_recompute=config.recompute_attention
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
        document_mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        return dropout_add(self, self.self_attention(h, rotary, inference_context, **mask_kwargs(document_mask)), x)


class MLPLayer(_Residual):
    """``-`` (dense) or ``E`` (routed experts, ``moe``): ``x + mlp(pre_mlp_layernorm(x))``, the MLP half of a
    Transformer layer (its parameter names)."""

    def __init__(
        self,
        config: TransformerConfig,
        ctx: ModelContext,
        spec: LayerSpec,
        layer_number: int,
        prefix: str,
        moe: bool = False,
    ) -> None:
        super().__init__(config, ctx, layer_number)
        self.pre_mlp_layernorm = spec.norm(config, config.hidden_size, ctx.device, ctx.sequence_parallel)
        self.mlp = (spec.moe if moe else spec.mlp)(config, ctx, spec, f"{prefix}.mlp")
        self.recompute_mlp = config.recompute_mlp and not moe

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
        document_mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        return dropout_add(self, norm_mlp(self, x), x)


def hybrid_layer(
    config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, layer_number: int, prefix: str
) -> nn.Module:
    """Layer ``layer_number`` of the config's ``hybrid_pattern`` (the ``LayerSpec.layer`` of hybrid models)."""
    if config.hybrid_pattern is None:
        raise ValueError("hybrid_layer needs TransformerConfig.hybrid_pattern")
    kind = layer_kinds(config.hybrid_pattern)[layer_number]
    if kind == "M":
        from mcore_models.ssm.layer import MambaLayer  # (the mixer itself comes from the spec)

        return MambaLayer(config, ctx, spec, layer_number, prefix)
    if kind == "*":
        return AttentionLayer(config, ctx, spec, layer_number, prefix)
    return MLPLayer(config, ctx, spec, layer_number, prefix, moe=kind == "E")


def hybrid_spec(spec: LayerSpec | None = None) -> LayerSpec:
    """``spec`` (default: the pure-PyTorch one) with its layers built from the pattern."""
    from mcore_models.spec import default_spec

    return replace(spec or default_spec(), layer=hybrid_layer)


def gpt_layer_names(gpt_layers: int, pattern: str) -> dict[str, str]:
    """Where a GPT checkpoint's layer parameters go in a hybrid model: a name prefix map from
    ``decoder.layers.{k}.`` parts of the GPT model to the hybrid layers. GPT layer ``k`` is the ``k``-th ``*-`` pair
    of the pattern: its ``input_layernorm`` and ``self_attention`` go to the ``*``, its ``pre_mlp_layernorm`` and
    ``mlp`` to the ``-`` right after it. A pattern whose ``*-`` pairs do not number ``gpt_layers`` is a
    ``ValueError``."""
    kinds = layer_kinds(pattern)
    pairs = [i for i in range(len(kinds) - 1) if kinds[i] == "*" and kinds[i + 1] == "-"]
    if len(pairs) != gpt_layers:
        raise ValueError(
            f"hybrid_pattern={pattern!r} has {len(pairs)} attention + MLP pairs ('*-'), the GPT model {gpt_layers} "
            "layers: each GPT layer needs one '*-' pair"
        )
    names = {}
    for k, i in enumerate(pairs):
        for part in ("input_layernorm", "self_attention"):
            names[f"decoder.layers.{k}.{part}."] = f"decoder.layers.{i}.{part}."
        for part in ("pre_mlp_layernorm", "mlp"):
            names[f"decoder.layers.{k}.{part}."] = f"decoder.layers.{i + 1}.{part}."
    return names
