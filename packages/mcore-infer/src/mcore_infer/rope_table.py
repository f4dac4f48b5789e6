"""The rotary tables of every position a served model can reach, computed once: a step's cos and sin gathered.

``GPTModel``'s ``RotaryEmbedding`` computes cos and sin of each step's positions from its inverse frequencies, six
small kernels a step (the cast of the positions, the product, the concatenation, cos, sin, and each cast to the
model's dtype). A serving step at batch 1 is bound by its number of kernels, so :class:`RotaryTable` computes those
same values once for positions ``[0, positions)`` with the same module (bit for bit the values it would compute for
any one step: each is an elementwise function of its position) and a step gathers its rows: two kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.transformer.rope import RotaryEmbedding

__all__ = ["RotaryTable"]


class RotaryTable(nn.Module):
    """``rope``'s ``(cos, sin)`` for positions ``[0, positions)`` in ``dtype``; called like ``rope(position_ids,
    dtype)`` for those positions (a position outside them is the caller's error: the engine admits no request past
    its ``max_model_len``). Asked for another dtype, it calls ``rope``."""

    def __init__(self, rope: RotaryEmbedding, positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        if positions < 1:
            raise ValueError(f"RotaryTable: positions={positions} must be at least 1")
        self.positions, self.dtype, self.rot = positions, dtype, rope.rot_dim
        self.rope = rope  # (shared with the model, not copied)
        with torch.no_grad():
            cos, sin = rope(torch.arange(positions, device=rope.inv_freq.device), dtype)  # [n, 1, 1, rot] each
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos[:, 0, 0].contiguous(), persistent=False)
        self.register_buffer("sin", sin[:, 0, 0].contiguous(), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[s, b or 1, 1, rot]`` of ``position_ids`` ``[s]`` or ``[s, b]``, contiguous as the RoPE
        returns them (compiled layers see the same layouts)."""
        if dtype != self.dtype:
            return self.rope(position_ids, dtype)  # type: ignore[no-any-return]
        pos = position_ids if position_ids.dim() == 2 else position_ids[:, None]
        return F.embedding(pos, self.cos)[:, :, None], F.embedding(pos, self.sin)[:, :, None]
