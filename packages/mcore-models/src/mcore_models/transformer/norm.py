"""LayerNorm and RMSNorm on the last dimension (``F.layer_norm`` / ``F.rms_norm``: fused kernels on GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig

__all__ = ["RMSNorm", "LayerNorm", "build_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def build_norm(
    config: TransformerConfig, dim: int, device: torch.device | str | None, sequence_parallel: bool = False
) -> nn.Module:
    """The config's normalisation over ``dim``. Under sequence parallelism its parameters see only this rank's
    part of the sequence, so they are marked ``sequence_parallel`` for the gradient all-reduce."""
    cls = RMSNorm if config.normalization == "rmsnorm" else LayerNorm
    norm = cls(dim, config.norm_eps, config.dtype, device)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
    return norm
