"""``MambaLayer``: a pre-norm residual block around a Mamba-2 mixer, ``x + dropout(mixer(norm(x)))``.

It has the constructor signature of every layer (``config, ctx, spec, layer_number, prefix``), so a model loop (or a
hybrid pattern's ``M``) builds it like a :class:`~mcore_models.transformer.layer.TransformerLayer`; the mixer comes
from ``spec.mamba_mixer`` so a backend can replace it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.layer import dropout_add

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = ["MambaLayer"]


class MambaLayer(nn.Module):
    """``input_layernorm`` (the spec's norm) and ``mixer`` (``spec.mamba_mixer``, :class:`Mamba2Mixer` by
    default); parameters ``{prefix}.input_layernorm.weight`` and ``{prefix}.mixer.*``."""

    def __init__(
        self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, layer_number: int, prefix: str
    ) -> None:
        super().__init__()
        self.layer_number, self.ctx = layer_number, ctx
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = spec.norm(config, config.hidden_size, ctx.device, ctx.sequence_parallel)
        self.mixer = spec.mamba_mixer(config, ctx, spec, f"{prefix}.mixer")

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: Any = None,
    ) -> torch.Tensor:
        """``x + dropout(mixer(norm(x)))`` for ``x`` ``[s (/ tp), b, hidden]`` (``rotary`` is not used).

        With an engine's ``inference_context`` (flat tokens ``[T, 1, hidden]`` of many requests), the mixer runs
        :func:`~mcore_models.ssm.inference.mixer_inference_forward` over the requests' conv and SSM states."""
        if inference_context is not None:
            return x + self.mixer(self.input_layernorm(x), inference_context=inference_context)
        return dropout_add(self, self.mixer(self.input_layernorm(x)), x)
