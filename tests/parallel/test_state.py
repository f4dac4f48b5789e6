"""ParallelState on real gloo process groups: memberships agree with the layout and every group communicates."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed

KINDS = ["tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "mp", "tp_dp_cp", "ep", "expert_tp", "expert_dp", "expert_tp_ep"]


def _check_state(cfg: ParallelConfig) -> dict:
    state = ParallelState.initialize(cfg)
    rank = dist.get_rank()
    out = {}
    for kind in KINDS:
        g = getattr(state, kind)
        assert g.ranks == state.layout.group_of(kind, rank)
        assert g.ranks[g.rank] == rank
        # the process group really spans exactly these ranks: sum of global ranks over the group
        t = torch.tensor([float(rank)])
        if g.pg is not None:
            dist.all_reduce(t, group=g.pg)
        out[kind] = (g.ranks, t.item())
    if state.embedding.is_member and state.embedding.pg is not None:
        t = torch.ones(1)
        dist.all_reduce(t, group=state.embedding.pg)
        assert t.item() == state.embedding.size
    out["first_last"] = (state.is_first_stage, state.is_last_stage, state.pp_prev_rank, state.pp_next_rank)
    state.destroy()
    return out


@pytest.mark.parametrize(
    "world,cfg",
    [
        (2, ParallelConfig(tp=2)),
        (4, ParallelConfig(tp=2, pp=2)),
        (4, ParallelConfig(cp=2, ep=2, order="tp-dp-ep-cp-pp")),
        (8, ParallelConfig(tp=2, pp=2, ep=2)),
        (8, ParallelConfig(pp=4, vpp=2)),
    ],
    ids=["tp2", "tp2pp2", "cp2ep2-order", "tp2pp2ep2", "pp4vpp2"],
)
def test_groups_match_layout_and_communicate(world: int, cfg: ParallelConfig) -> None:
    results = run_distributed(_check_state, world, cfg)
    for rank, res in enumerate(results):
        for kind in KINDS:
            ranks, total = res[kind]
            assert total == float(sum(ranks)), (rank, kind)
        first, last, prev, nxt = res["first_last"]
        pp = res["pp"][0]
        i = pp.index(rank)
        assert first == (i == 0) and last == (i == len(pp) - 1)
        assert prev == pp[i - 1] and nxt == pp[(i + 1) % len(pp)]


def test_world_size_one_needs_no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    state = ParallelState.initialize(ParallelConfig())
    assert not dist.is_initialized()
    assert state.backend is None and state.device == torch.device("cpu")
    assert all(getattr(state, k).size == 1 and getattr(state, k).pg is None for k in KINDS)
    assert state.is_first_stage and state.is_last_stage and state.dp_size == 1


def test_bad_layout_fails_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    from mcore_parallel import ParallelConfigError

    with pytest.raises(ParallelConfigError, match="world size 1 is not divisible by tp"):
        ParallelState.initialize(ParallelConfig(tp=2))
    assert not dist.is_initialized()


def test_single_process_uses_the_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_parallel.state import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device(None, 0) == torch.device("cuda", 0)  # one process, no launcher: still on the GPU
    assert default_device("cpu:gloo,cuda:nccl", 3) == torch.device("cuda", 3)
    assert default_device("gloo", 0) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(None, 0) == torch.device("cpu")
