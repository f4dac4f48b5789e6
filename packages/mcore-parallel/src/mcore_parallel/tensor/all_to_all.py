"""All-to-all with variable splits, autograd-correct: the exchange of expert parallelism.

``all_to_all(x, group, output_splits, input_splits)`` sends rows ``x[sum(input_splits[:j]) : ...]`` to rank ``j``
of ``group`` and returns the rows every rank sent here, in rank order (``output_splits[j]`` from rank ``j``). Its
backward is the same exchange with the splits swapped. :func:`exchange_counts` trades per-destination counts so
that both sides know the splits. With one member both are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group

__all__ = ["all_to_all", "exchange_counts"]


def _exchange(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group.pg)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> Any:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(g, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Exchange rows of ``x`` over ``group`` (see the module docstring); differentiable."""
    if group.size == 1:
        return x
    if len(input_splits) != group.size or len(output_splits) != group.size:
        raise ValueError(f"splits {input_splits} / {output_splits} need one entry per rank of the group ({group.size})")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input_splits {input_splits} sum to {sum(input_splits)}, not the {x.shape[0]} rows of x")
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``counts`` ``[group.size, ...]`` (row ``j``: what this rank sends to rank ``j``) → the rows every rank sent
    here (row ``j``: what rank ``j`` sends to this rank). One small collective, no host synchronisation."""
    if group.size == 1:
        return counts
    if counts.shape[0] != group.size:
        raise ValueError(f"counts have {counts.shape[0]} rows; the group has {group.size} ranks")
    out = torch.empty_like(counts.contiguous())
    dist.all_to_all_single(out, counts.contiguous(), group=group.pg)
    return out
