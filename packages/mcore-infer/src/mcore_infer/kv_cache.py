"""The paged KV cache: fixed-size blocks in one tensor per layer, and the block manager that hands them out.

Block 0 is reserved as a scratch block: padded rows of a CUDA-graph batch write their keys/values there, so no
real request's block is ever touched by padding. A request holds a block table (a list of block ids); position
``p`` of the request lives in block ``table[p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockManager", "KVCache", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Free-list allocator of KV blocks (ids 1..num_blocks-1; 0 is the scratch block)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is reserved as scratch)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Blocks a request can ever use (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out[::-1]

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` to hold ``num_tokens`` tokens; False (nothing taken) when blocks are short."""
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self.allocate(need))
        return True

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()


@dataclass
class KVCache:
    """Per local layer: keys and values, each ``[num_blocks, block_size, groups, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, groups, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values, block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, groups: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * groups * head_dim * torch.empty((), dtype=dtype).element_size()
