"""The word-embedding weight shared between the first and the last pipeline stage (tied input/output embeddings).

The model marks the shared weight with ``shared_embedding = True`` on both stages (only the first stage when the
pipeline has one stage, where the weight is a single parameter used twice). Each copy gets only part of the gradient,
so the gradients are summed over ``state.embedding`` (the first and last stage of each pipeline) before the
optimizer step, and the last stage's copy starts as a copy of the first stage's. Both helpers do nothing with one
pipeline stage or on stages outside the embedding group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.state import ParallelState
from mcore_parallel.tensor import _comm

__all__ = ["shared_embedding_params", "sync_shared_embedding_weights", "allreduce_shared_embedding_grads"]

logger = logging.getLogger(__name__)


def shared_embedding_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters marked ``shared_embedding=True`` in ``modules`` (in module order, each once)."""
    seen: set[int] = set()
    found = []
    for m in modules:
        for p in m.parameters():
            if getattr(p, "shared_embedding", False) and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found


def _active(state: ParallelState) -> bool:
    return state.embedding.is_member and state.embedding.size > 1


@torch.no_grad()
def sync_shared_embedding_weights(modules: Iterable[nn.Module], state: ParallelState) -> None:
    """Copy the first stage's shared embedding weights to the last stage (call once, after building the model)."""
    if not _active(state):
        return
    for p in shared_embedding_params(modules):
        dist.broadcast(p.data, src=state.embedding.ranks[0], group=state.embedding.pg)


@torch.no_grad()
def allreduce_shared_embedding_grads(modules: Iterable[nn.Module], state: ParallelState) -> None:
    """Sum the gradients (``main_grad`` when present, else ``grad``) of shared embedding weights over both stages."""
    if not _active(state):
        return
    grads = []
    for p in shared_embedding_params(modules):
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is None:
            raise RuntimeError(
                f"shared embedding parameter of shape {tuple(p.shape)} on global rank {state.rank} has no gradient; "
                "run backward before reducing, or unmark it (shared_embedding=False) if it is not tied"
            )
        grads.append(g)
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        _comm.all_reduce(flat, state.embedding)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
