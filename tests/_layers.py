"""A layer type that is not mcore's standard layer, shared by the model and inference tests (and the worked example of
``docs/architecture.md``): a GPT-J style parallel block built from a ``LayerSpec``'s parts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcore_models import LayerSpec


class ParallelBlock(nn.Module):
    """``x + attn(norm(x)) + mlp(norm(x))``: attention and MLP read the same normalised input (GPT-J, PaLM)."""

    def __init__(self, config: Any, ctx: Any, spec: LayerSpec, layer_number: int, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = spec.norm(config, config.hidden_size, ctx.device, ctx.sequence_parallel)
        self.self_attention = spec.attention(config, ctx, spec, f"{prefix}.self_attention", selective_recompute=False)
        self.mlp = spec.mlp(config, ctx, spec, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, rotary: Any = None, inference_context: Any = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attention(h, rotary, inference_context) + self.mlp(h)
