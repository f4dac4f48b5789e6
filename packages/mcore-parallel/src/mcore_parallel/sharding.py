"""Where each rank's piece of a parameter sits in the global (unsharded, unpadded) tensor.

Checkpoint and export code work on global tensors so that any layout can load any other. :func:`shard_info`
reads the attributes the TP layers set (``partition_dim``, ``partition_stride``, ``global_shape``) and returns the
pairs of (local index, global index) slices this rank holds. Vocabulary padding rows are outside the global shape
and are simply not listed. ``replica`` is true on ranks whose copy is identical to one held by a lower TP rank
(TP-replicated parameters), so writers can skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_parallel.state import Group

__all__ = ["ShardedTensor", "shard_info"]

Index = tuple[slice, ...]


@dataclass(frozen=True)
class ShardedTensor:
    """This rank's piece of the global tensor ``key``."""

    key: str
    local: torch.Tensor
    global_shape: tuple[int, ...]
    pieces: tuple[tuple[Index, Index], ...]  # (index into local, index into the global tensor)
    replica: bool = False
    chunk_shape: tuple[int, ...] | None = None
    """A chunking of the global tensor in which every piece starts on a chunk boundary (None: one chunk)."""

    def scatter_into(self, full: torch.Tensor) -> None:
        """Write this rank's pieces into a global-shaped tensor (for tests and small models)."""
        for local_idx, global_idx in self.pieces:
            full[global_idx] = self.local[local_idx].to(full.dtype)

    def load_from(self, full: torch.Tensor) -> None:
        """Fill this rank's pieces from a global-shaped tensor (padding rows are left untouched)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"{self.key}: expected global shape {self.global_shape}, got {tuple(full.shape)}")
        with torch.no_grad():
            for local_idx, global_idx in self.pieces:
                self.local[local_idx].copy_(full[global_idx])


def shard_info(key: str, tensor: torch.Tensor, tp: Group, like: torch.Tensor | None = None) -> ShardedTensor:
    """Describe ``tensor`` (a parameter, or e.g. an optimizer state shaped like parameter ``like``) globally."""
    meta = like if like is not None else tensor
    full = tuple(tensor.shape)
    if not getattr(meta, "tensor_model_parallel", False):
        everything = tuple(slice(0, n) for n in full)
        return ShardedTensor(key, tensor, full, ((everything, everything),), replica=tp.rank > 0)
    dim: int = meta.partition_dim  # type: ignore[attr-defined]
    stride: int = getattr(meta, "partition_stride", 1)
    global_shape: tuple[int, ...] = tuple(meta.global_shape)  # type: ignore[attr-defined]
    local_len = tensor.shape[dim]
    block_local = local_len // stride  # this rank's rows of one block
    block_global = block_local * tp.size  # padded size of one block
    pieces = []
    for j in range(stride):
        g_start = j * block_global + tp.rank * block_local
        g_end = min(g_start + block_local, global_shape[dim])
        if g_end <= g_start:
            continue
        l_start = j * block_local
        local_idx = [slice(0, n) for n in full]
        global_idx = [slice(0, n) for n in global_shape]
        local_idx[dim] = slice(l_start, l_start + (g_end - g_start))
        global_idx[dim] = slice(g_start, g_end)
        pieces.append((tuple(local_idx), tuple(global_idx)))
    chunk = list(global_shape)
    chunk[dim] = max(block_local, 1)
    return ShardedTensor(key, tensor, global_shape, tuple(pieces), replica=False, chunk_shape=tuple(chunk))
