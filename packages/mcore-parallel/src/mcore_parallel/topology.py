"""Which exchange a group's communication can use on this machine: topology probes and the ``auto`` choices.

The tensor-parallel linears under sequence parallelism can exchange through NCCL collectives, PyTorch's fused
symmetric-memory ops, or mcore's own peer-to-peer exchange (:mod:`mcore_parallel.tensor.p2p`); the data-parallel
gradient reduction through NCCL or peer-to-peer copies (:class:`~mcore_parallel.ddp.DDPConfig` ``exchange``). The
peer-to-peer paths need every rank of the group on this host with peer access between its GPUs. The functions here
answer from a :class:`~mcore_parallel.ParallelState` value; the caller turns the answer into a value of its own
(:func:`~mcore_parallel.tensor.with_symmetric_memory`, a ``DDPConfig``).
"""

from __future__ import annotations

import logging

import torch

from mcore_parallel.state import Group, ParallelState

__all__ = ["P2P_AUTO_SIZES", "TP_COMMS", "DP_COMMS", "peer_access", "resolve_tp_comm", "resolve_dp_comm"]

logger = logging.getLogger(__name__)

TP_COMMS = ("auto", "nccl", "symmetric_memory", "p2p")
DP_COMMS = ("auto", "nccl", "p2p")

P2P_AUTO_SIZES = (2,)
"""Group sizes at which ``auto`` picks mcore's p2p exchanges: those measured and parity-tested on GPUs (2x H200).
Larger groups are tested on CPU only; ``p2p`` can be asked for explicitly at any size."""


def peer_access(group: Group, state: ParallelState) -> str | None:
    """Why ``group``'s GPUs cannot exchange through symmetric memory (``None`` when they can): CUDA, every rank of
    the group on this host (``state.local_world_size`` consecutive ranks per host, as torchrun places them) with
    peer access to this GPU, and a PyTorch with symmetric memory."""
    if state.device.type != "cuda":
        return "not on CUDA"
    first = state.rank - state.local_rank
    local_world = state.local_world_size
    if local_world < group.size or any(not first <= r < first + local_world for r in group.ranks):
        return f"the {group.kind} group spans hosts"
    me = state.device.index if state.device.index is not None else state.local_rank
    peers = [r - first for r in group.ranks if r != state.rank]
    if any(d >= torch.cuda.device_count() for d in peers) or not all(
        torch.cuda.can_device_access_peer(me, d) for d in peers
    ):
        return f"no peer access between the {group.kind} group's GPUs"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "this PyTorch has no symmetric memory"
    return None


def resolve_tp_comm(tp_comm: str, sequence_parallel: bool, state: ParallelState) -> str:
    """The tensor-parallel exchange for ``tp_comm``: ``auto`` becomes ``p2p`` (mcore's exchange over symmetric
    memory) when the sequence-parallel linears can use it (tp > 1 with sequence parallelism, and :func:`peer_access`)
    at a size in :data:`P2P_AUTO_SIZES`, ``symmetric_memory`` (PyTorch's fused ops) at other sizes, else ``nccl``."""
    if tp_comm not in TP_COMMS:
        raise ValueError(f"tp_comm={tp_comm!r} must be one of {', '.join(TP_COMMS)}")
    if tp_comm != "auto":
        return tp_comm
    if state.tp.size < 2 or not sequence_parallel:
        return "nccl"
    why_not = peer_access(state.tp, state)
    if why_not is not None:
        logger.info("tp_comm=auto: %s, using nccl", why_not)
        return "nccl"
    if state.tp.size not in P2P_AUTO_SIZES:
        logger.info("tp_comm=auto: PyTorch's fused symmetric-memory ops at tp%d (mcore's p2p exchange is measured "
                    "on GPUs at tp2 only; tp_comm=p2p asks for it)", state.tp.size)  # fmt: skip
        return "symmetric_memory"
    logger.info("tp_comm=auto: sequence-parallel linears through mcore's exchange over symmetric memory (p2p)")
    return "p2p"


def resolve_dp_comm(dp_comm: str, state: ParallelState) -> str:
    """The data-parallel exchange for ``dp_comm``: ``auto`` becomes ``p2p`` (gradient and parameter exchange by
    peer-to-peer copies on the copy engines) when the data-parallel group's size is in :data:`P2P_AUTO_SIZES` and
    :func:`peer_access` allows it, else ``nccl``."""
    if dp_comm not in DP_COMMS:
        raise ValueError(f"dp_comm={dp_comm!r} must be one of {', '.join(DP_COMMS)}")
    if dp_comm != "auto":
        return dp_comm
    if state.dp_cp.size < 2:
        return "nccl"
    why_not = peer_access(state.dp_cp, state)
    if why_not is None and state.dp_cp.size not in P2P_AUTO_SIZES:
        why_not = f"the p2p exchange is measured on GPUs at dp2 only (dp{state.dp_cp.size}; dp_comm=p2p asks for it)"
    if why_not is not None:
        logger.info("dp_comm=auto: %s, using nccl", why_not)
        return "nccl"
    logger.info("dp_comm=auto: gradients and parameters exchanged by peer-to-peer copies (p2p)")
    return "p2p"
