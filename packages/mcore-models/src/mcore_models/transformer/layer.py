"""A pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)), with dropout before each add."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.packed import DocumentMask, mask_kwargs

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec
    from mcore_models.transformer.attention import InferenceContext

__all__ = ["TransformerLayer", "dropout_add", "hidden_dropout", "norm_mlp", "recomputes_mlp"]


def dropout_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + dropout(x)`` with ``layer``'s ``hidden_dropout`` while it trains, drawn in its context's
    sequence-parallel RNG region (every layer kind's residual add)."""
    return residual + hidden_dropout(layer, x)


def hidden_dropout(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x)`` as :func:`dropout_add` draws it (``x`` itself unless ``layer`` trains with dropout)."""
    p: float = getattr(layer, "hidden_dropout", 0.0)
    if p > 0 and layer.training:
        ctx: ModelContext = layer.ctx  # type: ignore[assignment]
        with ctx.sp_region_rng():
            x = F.dropout(x, p, training=True)
    return x


def norm_mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer.mlp(layer.pre_mlp_layernorm(x))``, recomputed in backward from ``x`` alone when the layer's
    ``recompute_mlp`` is set (``TransformerConfig.recompute_modules`` with ``mlp``) and it trains.

    A compiled caller with an MLP that breaks the graph (the FP8 linears, run eagerly) calls :func:`recomputes_mlp`
    and, where it is False, the norm itself before ``layer.mlp``: the norm is then in the graph of the residual add
    before it (one kernel each way), where a call of this function would end that graph before the norm."""
    if recomputes_mlp(layer):
        ctx: ModelContext = layer.ctx  # type: ignore[assignment]
        return ctx.recompute(_NormMLP(layer), x)
    return layer.mlp(layer.pre_mlp_layernorm(x))  # type: ignore[operator, no-any-return]


def recomputes_mlp(layer: nn.Module) -> bool:
    """Whether :func:`norm_mlp` recomputes ``layer``'s pre-MLP norm and MLP in backward."""
    return bool(getattr(layer, "recompute_mlp", False) and layer.training)


class _NormMLP:
    """The pre-MLP norm and MLP of ``layer`` as one function (what ``norm_mlp`` recomputes)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.mlp(self.layer.pre_mlp_layernorm(x))  # type: ignore[operator, no-any-return]


class TransformerLayer(nn.Module):
    def __init__(
        self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, layer_number: int, prefix: str
    ) -> None:
        super().__init__()
        self.layer_number, self.ctx = layer_number, ctx
        self.hidden_dropout = config.hidden_dropout
        sp = ctx.sequence_parallel
        self.input_layernorm = spec.norm(config, config.hidden_size, ctx.device, sp)
        self.self_attention = spec.attention(
            config, ctx, spec, f"{prefix}.self_attention", selective_recompute=config.recompute_attention
        )
        self.pre_mlp_layernorm = spec.norm(config, config.hidden_size, ctx.device, sp)
        moe_layer = config.moe is not None and config.moe.is_moe_layer(layer_number)
        self.mlp = (spec.moe if moe_layer else spec.mlp)(config, ctx, spec, f"{prefix}.mlp")
        self.recompute_mlp = config.recompute_mlp and not moe_layer

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return dropout_add(self, x, residual)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
        document_mask: DocumentMask | None = None,
        *,
        pending: torch.Tensor | None = None,
        defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer's output ``x + attn + mlp`` for ``x`` ``[s, b, hidden]`` (``inference_context``: attention over
        an engine's KV cache, see :class:`~mcore_models.transformer.attention.InferenceContext`; ``document_mask``:
        packed sequences, see :mod:`~mcore_models.transformer.packed`).

        The deferred residual add (``TransformerConfig.defer_residual_add``): ``pending`` is added to ``x`` first
        (the layer before's last add, in the graph of this layer's input norm), and ``defer`` returns ``(x + attn,
        mlp)`` (with its dropout) for the next layer to add instead of their sum."""
        if pending is not None:
            x = x + pending
        attn = self.self_attention(self.input_layernorm(x), rotary, inference_context, **mask_kwargs(document_mask))
        x = self._dropout_add(attn, x)
        if recomputes_mlp(self):
            mlp = norm_mlp(self, x)
        else:  # the norm here, not inside a call: with the FP8 MLP (a graph break) the add and the norm stay one graph
            mlp = self.mlp(self.pre_mlp_layernorm(x))
        if defer:
            return x, hidden_dropout(self, mlp)
        return self._dropout_add(mlp, x)
