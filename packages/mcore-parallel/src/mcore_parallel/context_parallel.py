"""Context parallelism: which tokens of a sequence each rank of the ``cp`` group holds, and the ring exchange.

Causal load balancing: the sequence is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, in that order (its local sequence is increasing in global position). Under a causal mask the
early chunk of a rank sees few keys and its late chunk many, so every rank has the same attention work.

:func:`cp_split` takes a rank's tokens out of a full-sequence tensor (tokens, labels, loss mask, position ids);
:func:`ring_exchange` sends a tensor to the next rank of the ring and receives the previous rank's (asynchronous,
so a ring step's attention runs while its K/V travel); :func:`resolve_cp_comm` turns ``cp_comm=auto`` into ``p2p``
or ``allgather``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group

__all__ = ["cp_chunk_ids", "cp_index", "cp_split", "ring_exchange", "wait_all", "resolve_cp_comm", "CP_COMMS"]

CP_COMMS = ("p2p", "allgather")

AUTO_P2P_MIN_TOKENS = 4096
"""``cp_comm=auto`` rings K/V (``p2p``) when each cp rank holds at least this many tokens of a sequence, and
all-gathers them below (see :func:`resolve_cp_comm`)."""


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that cp rank ``cp_rank`` holds: ``(r, 2 * cp - 1 - r)``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_index(seq_length: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of cp rank ``cp_rank``'s tokens, in its local order (``seq_length / cp`` of them)."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 * cp = {2 * cp_size}")
    c = seq_length // (2 * cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]).to(device)


def cp_split(x: torch.Tensor, cp: Group, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` along ``dim`` (the sequence dimension), chunks ``r`` and ``2cp-1-r``."""
    if cp.size == 1:
        return x
    s = x.shape[dim]
    if s % (2 * cp.size):
        raise ValueError(f"sequence length {s} is not divisible by 2 * cp = {2 * cp.size}")
    chunks = x.chunk(2 * cp.size, dim)
    first, second = cp_chunk_ids(cp.size, cp.rank)
    return torch.cat([chunks[first], chunks[second]], dim)


def ring_exchange(x: torch.Tensor, cp: Group) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``x`` to the next rank of ``cp`` and receiving the previous rank's tensor of the same shape;
    returns (the receive buffer, the requests: :func:`wait_all` them before reading it or writing ``x``)."""
    recv = torch.empty_like(x)
    nxt = cp.ranks[(cp.rank + 1) % cp.size]
    prv = cp.ranks[(cp.rank - 1) % cp.size]
    ops = [dist.P2POp(dist.isend, x.contiguous(), nxt, cp.pg), dist.P2POp(dist.irecv, recv, prv, cp.pg)]
    return recv, list(dist.batch_isend_irecv(ops))


def wait_all(requests: list[Any]) -> None:
    for r in requests:
        r.wait()


def resolve_cp_comm(choice: str, seq_length: int, cp_size: int) -> str:
    """``p2p`` or ``allgather`` for ``parallel.cp_comm`` (``auto`` resolved).

    A reasoned rule, not measured: a ring step computes one block of about ``(s/cp)^2 / 2`` scores per head while
    the next K/V block (``s/cp`` tokens per query group) travels, and there are ``cp - 1`` such steps, each with its
    own send latency and launches. Below :data:`AUTO_P2P_MIN_TOKENS` tokens per rank a block takes tens of
    microseconds on an H200 (the order of a send's latency), so the ring cannot hide its steps and one all-gather of
    K/V (started before the local block, which it overlaps) is cheaper; from there on each step's attention is
    several times its transfer, and the ring keeps only two K/V blocks in memory instead of the whole sequence's.
    """
    if choice not in ("auto", *CP_COMMS):
        raise ValueError(f"cp_comm={choice!r} must be auto, p2p or allgather")
    if choice != "auto":
        return choice
    return "p2p" if cp_size > 1 and seq_length // cp_size >= AUTO_P2P_MIN_TOKENS else "allgather"
