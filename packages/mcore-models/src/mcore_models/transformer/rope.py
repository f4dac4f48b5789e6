"""Rotary position embeddings (RoPE), including partial rotation and Llama-3 frequency scaling.

The rotate-half convention (first half of the rotated dimensions paired with the second half) is the one Hugging
Face Llama checkpoints are stored in, so weights convert without permutation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mcore_models.config import RopeScaling

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inv_freq"]


def rope_inv_freq(dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies ``base^(-2i/dim)`` (float64), optionally with Llama-3 scaling."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is None:
        return inv
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Produces ``(cos, sin)`` of shape ``[s, b or 1, 1, rot_dim]`` for given positions."""

    def __init__(self, rot_dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str | None):
        super().__init__()
        self.rot_dim = rot_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(rot_dim, base, scaling).float().to(device), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids``: ``[s]`` or ``[s, b]``."""
        pos = position_ids.to(self.inv_freq.device, torch.float32)
        if pos.dim() == 1:
            pos = pos[:, None]
        freqs = pos[..., None] * self.inv_freq  # [s, b, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [s, b, 1, rot]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of ``x`` (``[s, b, ..., d]``, ``cos``/``sin`` broadcast over the
    middle dimensions); the rest pass through. Four elementwise kernels (``addcmul`` fuses the last multiply-add)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, _rotate_half(x), sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([torch.addcmul(x_rot * cos, _rotate_half(x_rot), sin), x_pass], dim=-1)
