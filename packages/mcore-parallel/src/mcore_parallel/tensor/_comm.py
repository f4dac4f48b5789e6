"""Collectives over a :class:`~mcore_parallel.state.Group`, each a no-op when the group has one member.

Gathers and reduce-scatters along any dimension are done as one flat collective along dim 0 (the only layout the
single-tensor collectives support) plus at most one copy to move the split dimension.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``x`` in place over ``group`` and return it."""
    if group.size > 1:
        dist.all_reduce(x, op=op, group=group.pg)
    return x


def _gather0(x: torch.Tensor, group: Group, async_op: bool) -> tuple[torch.Tensor, Any]:
    src = x.contiguous()
    out = torch.empty((group.size * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _all_gather_single(out, src, group=group.pg, async_op=async_op)


def _scatter0(x: torch.Tensor, group: Group, async_op: bool) -> tuple[torch.Tensor, Any]:
    if x.shape[0] % group.size:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {group.size}")
    src = x.contiguous()
    out = torch.empty((src.shape[0] // group.size, *src.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _reduce_scatter_single(out, src, group=group.pg, async_op=async_op)


def all_gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    out, _ = _gather0(x if dim == 0 else x.movedim(dim, 0), group, async_op=False)
    return out if dim == 0 else out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ``group`` and return this rank's chunk along ``dim``."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {group.size}")
    out, _ = _scatter0(x if dim == 0 else x.movedim(dim, 0), group, async_op=False)
    return out if dim == 0 else out.movedim(0, dim)


def all_gather_start(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, Any]:
    """Start concatenating every rank's ``x`` along dimension 0; returns (the output, a handle whose ``wait()`` makes
    it ready; None for a one-member group). This rank's own rows may be read before the wait only from ``x``."""
    return (x, None) if group.size == 1 else _gather0(x, group, async_op=True)


def reduce_scatter_start(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, Any]:
    """Start summing ``x`` over ``group`` and scattering dimension 0; returns (this rank's chunk, a handle whose
    ``wait()`` makes the chunk ready: the caller computes something else meanwhile). Handle None when no wait is
    needed (a one-member group)."""
    return (x, None) if group.size == 1 else _scatter0(x, group, async_op=True)


def split(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (contiguous)."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {group.size}")
    return x.chunk(group.size, dim)[group.rank].contiguous()
