"""Where each rank's piece of a parameter sits in the global (unsharded, unpadded) tensor.

Checkpoint and export code work on global tensors so that any layout can load any other. :func:`shard_info`
reads the attributes the TP layers set (``partition_dim``, ``partition_stride`` or ``partition_blocks``,
``global_shape``) and returns the pairs of (local index, global index) slices this rank holds. Vocabulary padding rows are outside the global shape
and are simply not listed. ``replica`` is true on ranks whose copy is identical to one held by a lower TP rank
(TP-replicated parameters), so writers can skip them.

Expert-parallel parameters (``expert_parallel = True``) are stacked per rank: dim 0 of the local tensor holds the
experts ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` given by ``expert_shard = (ep_rank, ep_size)``, and
``global_shape`` starts with the number of experts. They may also be TP-split (``tensor_model_parallel``) over the
*expert* tensor-parallel group, which the caller passes as ``tp``: :func:`shard_group` picks the right group for a
parameter. Copies of a parameter are identical over :func:`data_parallel_group` (``dp_cp`` for dense parameters,
``expert_dp`` for expert ones); checkpoint writers choose one member of that group per array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore_parallel.state import Group, ParallelState

__all__ = ["ShardedTensor", "shard_info", "shard_group", "data_parallel_group", "is_expert"]

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
    expert_parallel: bool = False
    """An expert parameter: its copies are identical over ``expert_dp``, not ``dp_cp`` (see data_parallel_group)."""
    optional: bool = False
    """State a checkpoint may lack (e.g. FP8 scaling histories, which only some backends keep): a load leaves the
    tensor as it is when the checkpoint has no array for it, instead of failing."""

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


def is_expert(param: Any) -> bool:
    """Whether ``param`` (a parameter or a :class:`ShardedTensor`) is an expert-parallel parameter."""
    return bool(getattr(param, "expert_parallel", False))


def shard_group(param: Any, state: ParallelState) -> Group:
    """The tensor-parallel group ``param`` is split over: ``state.expert_tp`` for expert parameters, else
    ``state.tp``. Pass it as ``tp`` to :func:`shard_info`."""
    return state.expert_tp if is_expert(param) else state.tp


def data_parallel_group(param: Any, state: ParallelState) -> Group:
    """The ranks holding identical copies of ``param`` (a parameter or a :class:`ShardedTensor`):
    ``state.expert_dp`` for expert parameters, else ``state.dp_cp``."""
    return state.expert_dp if is_expert(param) else state.dp_cp


def _expert_offset(key: str, meta: torch.Tensor, tensor: torch.Tensor, global_shape: tuple[int, ...]) -> int:
    """Global index of local expert 0 (checks ``expert_shard`` against the shapes)."""
    shard = getattr(meta, "expert_shard", None)
    if shard is None:
        raise ValueError(f"{key}: an expert_parallel parameter needs expert_shard = (ep_rank, ep_size)")
    ep_rank, ep_size = (int(v) for v in shard)
    local_experts = tensor.shape[0]
    if not 0 <= ep_rank < ep_size or local_experts * ep_size != global_shape[0]:
        raise ValueError(
            f"{key}: expert_shard={tuple(shard)} with {local_experts} local experts does not match "
            f"global_shape[0]={global_shape[0]} (expected local experts * ep_size == number of experts)"
        )
    return ep_rank * local_experts


def _tp_pieces(
    full: tuple[int, ...], global_shape: tuple[int, ...], dim: int, stride: int, tp: Group
) -> tuple[list[tuple[Index, Index]], int]:
    """The (local, global) slices of a TP split along ``dim`` with ``stride`` blocks, and one block's local length."""
    block_local = full[dim] // stride  # this rank's rows of one block
    block_global = block_local * tp.size  # padded size of one block
    pieces = []
    for j in range(stride):
        g_start = j * block_global + tp.rank * block_local
        g_end = min(g_start + block_local, global_shape[dim])
        if g_end <= g_start:
            continue
        pieces.append(_piece(full, global_shape, dim, j * block_local, g_start, g_end - g_start))
    return pieces, block_local


def _piece(full: tuple[int, ...], global_shape: tuple[int, ...], dim: int, local: int, start: int, n: int) -> Any:
    """``n`` rows along ``dim`` from ``local`` in the local tensor and from ``start`` in the global one."""
    local_idx = [slice(0, m) for m in full]
    global_idx = [slice(0, m) for m in global_shape]
    local_idx[dim] = slice(local, local + n)
    global_idx[dim] = slice(start, start + n)
    return tuple(local_idx), tuple(global_idx)


def _block_pieces(
    key: str, full: tuple[int, ...], global_shape: tuple[int, ...], dim: int, blocks: tuple[int, ...], tp: Group
) -> tuple[list[tuple[Index, Index]], int]:
    """The (local, global) slices of a TP split along ``dim`` of blocks of the global sizes ``blocks`` (each split
    over the group), and the chunk length along ``dim``: the largest that every piece's start and length is a
    multiple of, on every rank. A checkpoint writes each piece as one chunk, so pieces are cut to that length."""
    if sum(blocks) != global_shape[dim] or any(b % tp.size for b in blocks) or sum(blocks) // tp.size != full[dim]:
        raise ValueError(
            f"{key}: partition_blocks={blocks} do not split global dim {dim} of {global_shape} into local "
            f"{full[dim]} over {tp.size} ranks (each block must be divisible by the tensor-parallel size)"
        )
    if tp.size == 1:
        return [_piece(full, global_shape, dim, 0, 0, full[dim])], max(full[dim], 1)
    local_sizes = [b // tp.size for b in blocks]
    chunk = math.gcd(*local_sizes)
    pieces = []
    g_offset = l_offset = 0
    for b, n in zip(blocks, local_sizes, strict=True):
        start = g_offset + tp.rank * n
        pieces += [_piece(full, global_shape, dim, l_offset + i, start + i, chunk) for i in range(0, n, chunk)]
        g_offset, l_offset = g_offset + b, l_offset + n
    return pieces, chunk


def shard_info(key: str, tensor: torch.Tensor, tp: Group, like: torch.Tensor | None = None) -> ShardedTensor:
    """Describe ``tensor`` (a parameter, or e.g. an optimizer state shaped like parameter ``like``) globally.

    ``tp`` is the group the parameter is TP-split over (:func:`shard_group`: ``expert_tp`` for expert parameters).
    """
    meta = like if like is not None else tensor
    full = tuple(tensor.shape)
    expert = is_expert(meta)
    tensor_parallel = bool(getattr(meta, "tensor_model_parallel", False))
    if not expert and not tensor_parallel:
        everything = tuple(slice(0, n) for n in full)
        return ShardedTensor(key, tensor, full, ((everything, everything),), replica=tp.rank > 0)
    global_shape: tuple[int, ...] = tuple(meta.global_shape)  # type: ignore[attr-defined]
    if len(global_shape) != len(full):
        raise ValueError(f"{key}: global_shape {global_shape} and local shape {full} differ in rank")
    chunk = list(global_shape)
    if tensor_parallel:
        dim: int = meta.partition_dim % len(full)  # type: ignore[attr-defined]
        blocks = getattr(meta, "partition_blocks", None)
        if blocks is not None:
            pieces, block_local = _block_pieces(key, full, global_shape, dim, tuple(blocks), tp)
        else:
            pieces, block_local = _tp_pieces(full, global_shape, dim, getattr(meta, "partition_stride", 1), tp)
        chunk[dim] = max(block_local, 1)
    else:
        if full[1:] != global_shape[1:]:
            raise ValueError(
                f"{key}: local shape {full} and global_shape {global_shape} differ beyond dim 0, but the parameter "
                "is not marked tensor_model_parallel (set it, with partition_dim, for an expert-TP split)"
            )
        everything = tuple(slice(0, n) for n in full)
        pieces = [(everything, everything)]
    if expert:
        offset = _expert_offset(key, meta, tensor, global_shape)
        if tensor_parallel and meta.partition_dim % len(full) == 0:  # type: ignore[attr-defined]
            raise ValueError(f"{key}: an expert parameter cannot be TP-split along dim 0 (the expert dimension)")
        pieces = [(loc, (slice(loc[0].start + offset, loc[0].stop + offset), *g[1:])) for loc, g in pieces]
        chunk[0] = max(full[0], 1)
    replica = tp.rank > 0 and not tensor_parallel
    return ShardedTensor(key, tensor, global_shape, tuple(pieces), replica, tuple(chunk), expert_parallel=expert)
