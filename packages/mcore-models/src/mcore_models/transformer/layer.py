"""A pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)), with dropout before each add."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec
    from mcore_models.transformer.attention import InferenceContext

__all__ = ["TransformerLayer"]


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
            config, ctx, spec, f"{prefix}.self_attention", selective_recompute=config.recompute == "selective"
        )
        self.pre_mlp_layernorm = spec.norm(config, config.hidden_size, ctx.device, sp)
        self.mlp = spec.mlp(config, ctx, spec, f"{prefix}.mlp")

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout > 0 and self.training:
            with self.ctx.sp_region_rng():
                x = F.dropout(x, self.hidden_dropout, training=True)
        return residual + x

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
        residual: torch.Tensor | None = None,
        defer_residual: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer's output ``x + attn + mlp``.

        Inference can move each layer's last residual add into the next layer (``GPTModel.defer_residual_adds``):
        ``defer_residual=True`` returns ``(mlp output, residual)`` unsummed, and the next call adds them through
        ``residual=`` where its first norm reads them, so a compiled layer computes the add and the norm in one
        kernel (one kernel fewer per layer and decode step)."""
        if residual is not None:
            x = x + residual
        if inference_context is None:
            attn = self.self_attention(self.input_layernorm(x), rotary)
        else:  # inference: attention over the engine's KV cache (see InferenceContext)
            attn = self.self_attention(self.input_layernorm(x), rotary, inference_context)
        x = self._dropout_add(attn, x)
        out = self.mlp(self.pre_mlp_layernorm(x))
        if defer_residual:
            if self.training:
                raise RuntimeError("defer_residual is for inference (no dropout on the deferred add)")
            return out, x
        return self._dropout_add(out, x)
