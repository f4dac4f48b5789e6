"""The MLP: column-parallel up-projection, activation, row-parallel down-projection.

For SwiGLU the up-projection holds the gate and up halves (``[gate; up]`` globally, Megatron's layout) and is split
with stride 2, so every TP rank holds matching gate and up columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.fp8_swiglu import fp8_swiglu_mlp, fusion_problem
from mcore_models.transformer.swiglu import silu_mul, swiglu
from mcore_parallel.tensor import normal_init, scaled_normal_init

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = ["MLP", "activation_fn"]


def activation_fn(name: str) -> object:
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "squared_relu":
        return lambda x: F.relu(x).square()
    if name == "swiglu":
        return _swiglu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unknown activation {name!r}")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return silu_mul(gate, up)


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, prefix: str) -> None:
        super().__init__()
        common = dict(tp=ctx.tp, sequence_parallel=ctx.sequence_parallel, dtype=config.dtype, device=ctx.device)
        ffn = config.ffn_size
        self.linear_fc1 = spec.column_linear(
            config.hidden_size,
            2 * ffn if config.gated else ffn,
            bias=config.add_bias_linear,
            stride=2 if config.gated else 1,
            init_method=normal_init(config.init_method_std),
            seed=ctx.seed_for(f"{prefix}.linear_fc1.weight"),
            **common,
        )
        self.is_swiglu = config.activation == "swiglu"
        self.act = (
            swiglu
            if config.activation == "swiglu" and config.swiglu_backward == "triton"
            else activation_fn(config.activation)
        )
        out_init = (
            scaled_normal_init(config.init_method_std, config.num_layers)
            if config.scaled_output_init
            else normal_init(config.init_method_std)
        )
        self.linear_fc2 = spec.row_linear(
            ffn,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=out_init,
            seed=ctx.seed_for(f"{prefix}.linear_fc2.weight"),
            **common,
        )

        self.fp8_fused = False
        """Whether this MLP runs :func:`~mcore_models.transformer.fp8_swiglu.fp8_swiglu_mlp` (``fp8_fused_swiglu``
        and both linears in FP8)."""
        self.fp8_fused_calls = 0
        """How many forwards took the fused path (diagnostics, tests)."""
        if config.fp8_swiglu_fused:
            self.fp8_fused = fusion_problem(self.linear_fc1, self.linear_fc2) is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_fused:
            return fp8_swiglu_mlp(self, x)
        return self.linear_fc2(self.act(self.linear_fc1(x)))  # type: ignore[operator]
