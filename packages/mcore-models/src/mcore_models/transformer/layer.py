"""A pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)), with dropout before each add."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.norm_linear import MAX_ROWS, norm_linear
from mcore_models.transformer.small_gemv import add_deferred

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
        # inference: steps of at most MAX_ROWS tokens run each norm fused with the projection after it (and the
        # residual add before it, and SwiGLU after the up projection); see GPTModel.fuse_norm_linear
        self.fuse_norm_linear = False

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
        if inference_context is not None and self.fuse_norm_linear and x.shape[0] * x.shape[1] <= MAX_ROWS:
            return self._norm_linear_forward(x, rotary, inference_context, residual, defer_residual)
        if residual is not None:
            x = add_deferred(x, residual)  # the previous layer's output may be partial sums (fuse_swiglu_down)
        if inference_context is None:
            attn = self.self_attention(self.input_layernorm(x), rotary)
        else:  # inference: attention over the engine's KV cache (see InferenceContext)
            attn = self.self_attention(self.input_layernorm(x), rotary, inference_context)
        # the output projection's split-K partial sums (GPTModel.fuse_proj_partials) are summed by this add
        x = add_deferred(attn, x) if attn.dim() > x.dim() else self._dropout_add(attn, x)
        if defer_residual and getattr(self.mlp, "fuse_swiglu_down", False):
            out = self.mlp(self.pre_mlp_layernorm(x), partials=True)  # summed where the next layer adds them
        else:
            out = self.mlp(self.pre_mlp_layernorm(x))
        if defer_residual:
            if self.training:
                raise RuntimeError("defer_residual is for inference (no dropout on the deferred add)")
            return out, x
        return self._dropout_add(out, x)

    def _norm_linear_forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        inference_context: InferenceContext,
        residual: torch.Tensor | None,
        defer_residual: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The inference forward with both norms inside the projections after them (:func:`norm_linear`): the
        QKV projection adds the residual and normalises, the up projection adds the attention output and (SwiGLU)
        applies the activation. Same results as :meth:`forward` up to rounding."""
        ln1: Any = self.input_layernorm
        ln2: Any = self.pre_mlp_layernorm
        attention: Any = self.self_attention
        mlp: Any = self.mlp
        qkv, h = norm_linear(x, residual, ln1.weight, ln1.eps, attention.linear_qkv.weight)
        attn = attention(h, rotary, inference_context, qkv=qkv)
        act, h = norm_linear(attn, h, ln2.weight, ln2.eps, mlp.linear_fc1.weight, swiglu=mlp.is_swiglu)
        out = mlp.linear_fc2(act if mlp.is_swiglu else mlp.act(act))
        return (out, h) if defer_residual else h + out
