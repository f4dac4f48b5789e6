"""``mcore_parallel.topology``: which exchange ``auto`` picks for the tensor- and data-parallel groups, from the
ParallelState value (host placement, peer access, group size)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from mcore_parallel.topology import resolve_dp_comm, resolve_tp_comm


def _state(rank: int, ranks: tuple[int, ...], device: str = "cuda", local_world_size: int = 4) -> NS:
    local = rank % local_world_size
    dev = torch.device(device, local) if device == "cuda" else torch.device("cpu")
    group = NS(kind="tp", size=len(ranks), ranks=ranks)
    return NS(rank=rank, local_rank=local, local_world_size=local_world_size, device=dev, tp=group,
              dp_cp=NS(**{**group.__dict__, "kind": "dp"}))  # fmt: skip


def test_tp_and_dp_comm_auto_pick_the_p2p_exchange_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = {(0, 1): True, (1, 0): True, (0, 2): False}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer.get((a, b), True))
    s = _state
    assert resolve_tp_comm("auto", True, s(0, (0, 1))) == "p2p"
    assert resolve_tp_comm("auto", True, s(5, (4, 5))) == "p2p"  # second host, its own GPUs 0, 1
    assert resolve_tp_comm("auto", False, s(0, (0, 1))) == "nccl"  # no sequence parallelism
    assert resolve_tp_comm("auto", True, s(0, (0,))) == "nccl"  # tp = 1
    assert resolve_tp_comm("auto", True, s(0, (0, 1), "cpu")) == "nccl"
    assert resolve_tp_comm("auto", True, s(3, (3, 4))) == "nccl"  # spans two hosts
    assert resolve_tp_comm("auto", True, s(0, (0, 1), local_world_size=1)) == "nccl"  # one process per host
    assert resolve_tp_comm("auto", True, s(0, (0, 2))) == "nccl"  # no peer access
    assert resolve_tp_comm("nccl", True, s(0, (0, 1))) == "nccl"  # an explicit choice is kept
    assert resolve_tp_comm("symmetric_memory", True, s(0, (0, 1))) == "symmetric_memory"
    # the data-parallel group: the same rules, without the sequence-parallel condition
    assert resolve_dp_comm("auto", s(0, (0, 1))) == "p2p"
    assert resolve_dp_comm("auto", s(0, (0,))) == "nccl"  # dp = 1
    assert resolve_dp_comm("auto", s(3, (3, 4))) == "nccl"  # spans two hosts
    assert resolve_dp_comm("auto", s(0, (0, 2))) == "nccl"  # no peer access
    assert resolve_dp_comm("auto", s(0, (0, 1), "cpu")) == "nccl"
    assert resolve_dp_comm("nccl", s(0, (0, 1))) == "nccl"
    # larger groups: what was measured on GPUs (p2p at 2 ranks only); p2p still on request
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert resolve_tp_comm("auto", True, s(0, (0, 1, 2, 3))) == "symmetric_memory"
    assert resolve_dp_comm("auto", s(0, (0, 1, 2, 3))) == "nccl"
    assert resolve_tp_comm("p2p", True, s(0, (0, 1, 2, 3))) == "p2p"
    assert resolve_dp_comm("p2p", s(0, (0, 1, 2, 3))) == "p2p"


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="tp_comm='ring' must be one of auto, nccl, symmetric_memory, p2p"):
        resolve_tp_comm("ring", True, _state(0, (0, 1)))
    with pytest.raises(ValueError, match="dp_comm='ring' must be one of auto, nccl, p2p"):
        resolve_dp_comm("ring", _state(0, (0, 1)))


def test_the_launchers_local_world_size_reaches_the_state() -> None:
    from mcore_parallel import ParallelState
    from mcore_parallel._launch import LaunchEnv

    state = ParallelState.initialize(env=LaunchEnv(local_world_size=8))
    assert state.local_world_size == 8
