"""Column-parallel splits of unequal blocks (``blocks=``, a Mamba mixer's ``[z, x, B, C, dt]``): every block is split
over the TP ranks on its own, the weights are the tp=1 weights' slices, and checkpoints hold the global tensor and
reshard across TP sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.checkpoint import CheckpointManager
from mcore_parallel.tensor import ColumnParallelLinear, derive_seed, init_sharded_, set_tp_attributes
from mcore_parallel.testing import run_distributed

BLOCKS = (16, 16, 4, 4, 8)  # z, x, B, C, dt
CONV_BLOCKS = (16, 4, 4)  # x, B, C


def _uniform(t: torch.Tensor, generator: torch.Generator | None) -> object:
    return t.uniform_(-0.5, 0.5, generator=generator)


class Mixerish(nn.Module):
    """A column-parallel projection and a depthwise-conv-shaped parameter, both split by blocks."""

    def __init__(self, tp: Group) -> None:
        super().__init__()
        self.tp = tp
        self.proj = ColumnParallelLinear(8, sum(BLOCKS), tp=tp, blocks=BLOCKS, seed=derive_seed(5, "proj"))
        shape = (sum(CONV_BLOCKS), 1, 3)
        self.conv = nn.Parameter(torch.empty(sum(CONV_BLOCKS) // tp.size, 1, 3))
        set_tp_attributes(self.conv, 0, shape, blocks=CONV_BLOCKS)
        init_sharded_(self.conv, shape, 0, tp.rank, tp.size, _uniform, derive_seed(5, "conv"), blocks=CONV_BLOCKS)
        with torch.no_grad():
            assert self.proj.bias is not None
            self.proj.bias.copy_(torch.arange(self.proj.out_per_rank, dtype=torch.float32) + 100 * tp.rank)

    def named_items(self) -> dict[str, torch.Tensor]:
        assert self.proj.weight is not None and self.proj.bias is not None
        return {"proj.weight": self.proj.weight, "proj.bias": self.proj.bias, "conv": self.conv}

    def sharded_state_dict(self) -> dict:
        return {n: shard_info(n, p, self.tp) for n, p in self.named_items().items()}


def _slices(full: torch.Tensor, blocks: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    return torch.cat([b.chunk(world, 0)[rank] for b in full.split(list(blocks), 0)], 0)


@torch.no_grad()
def _gathered(net: Mixerish) -> dict[str, torch.Tensor]:
    """Every parameter's global tensor from the rank's pieces (each global element owned by exactly one rank)."""
    out = {}
    for key, info in net.sharded_state_dict().items():
        full = torch.full(info.global_shape, float("nan"))
        info.scatter_into(full)
        owned = (~full.isnan()).float()
        full = full.nan_to_num()
        if net.tp.size > 1:
            torch.distributed.all_reduce(full, group=net.tp.pg)
            torch.distributed.all_reduce(owned, group=net.tp.pg)
        assert torch.all(owned == 1), f"{key}: every global element belongs to exactly one rank"
        out[key] = full
    return out


def _build(tp: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    net = Mixerish(state.tp)
    local = {k: v.detach().clone() for k, v in net.named_items().items()}
    return local, _gathered(net), state.tp.rank


@pytest.mark.parametrize("tp", [2, 4])
def test_each_block_is_split_and_the_weights_are_the_tp1_weights_slices(tp: int) -> None:
    ref, _, _ = _build(1)
    for local, _glob, rank in run_distributed(_build, tp, tp):
        torch.testing.assert_close(local["proj.weight"], _slices(ref["proj.weight"], BLOCKS, rank, tp), rtol=0, atol=0)
        torch.testing.assert_close(local["conv"], _slices(ref["conv"], CONV_BLOCKS, rank, tp), rtol=0, atol=0)
        assert local["proj.weight"].shape == (sum(BLOCKS) // tp, 8)


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_info_puts_every_block_piece_in_its_global_place(tp: int) -> None:
    _, ref_global, _ = _build(1)
    sharded = run_distributed(_build, tp, tp)
    for key in ("proj.weight", "conv"):
        torch.testing.assert_close(sharded[0][1][key], ref_global[key], rtol=0, atol=0)
    # the bias was set per rank (arange + 100 * rank): rank r's part of each block sits at block offset + r * n / tp
    bias = sharded[0][1]["proj.bias"]
    glob = torch.zeros(sum(BLOCKS))
    for r in range(tp):
        local = torch.arange(sum(BLOCKS) // tp, dtype=torch.float32) + 100 * r
        g_off = l_off = 0
        for b in BLOCKS:
            n = b // tp
            glob[g_off + r * n : g_off + (r + 1) * n] = local[l_off : l_off + n]
            g_off, l_off = g_off + b, l_off + n
    torch.testing.assert_close(bias, glob, rtol=0, atol=0)


def _save(root: str, tp: int) -> dict[str, torch.Tensor]:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    net = Mixerish(state.tp)
    CheckpointManager(root, state).save("step_1", net.sharded_state_dict(), metadata={"step": 1})
    return _gathered(net)


def _load(root: str, tp: int) -> dict[str, torch.Tensor]:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    net = Mixerish(state.tp)
    with torch.no_grad():
        for p in net.named_items().values():
            p.zero_()
    CheckpointManager(root, state).load(net.sharded_state_dict())
    return _gathered(net)


@pytest.mark.parametrize(("save_tp", "load_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_block_split_checkpoint_reshards_across_tp(tmp_path: Path, save_tp: int, load_tp: int) -> None:
    saved = run_distributed(_save, save_tp, str(tmp_path), save_tp)[0]
    loaded = run_distributed(_load, load_tp, str(tmp_path), load_tp)[0]
    assert list(loaded) == list(saved)
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=key)


def test_bad_blocks_are_refused_naming_the_block() -> None:
    tp = Group("tp", (0, 1, 2, 3), 0)  # shapes only: nothing is communicated
    with pytest.raises(ValueError, match=r"block 4 of blocks=\(16, 16, 4, 4, 6\).*not divisible by .* 4"):
        ColumnParallelLinear(8, 46, tp=tp, blocks=(16, 16, 4, 4, 6), device="meta")
    with pytest.raises(ValueError, match=r"adding up to 40"):
        ColumnParallelLinear(8, 40, tp=tp, blocks=(16, 16, 4), device="meta")
    with pytest.raises(ValueError, match="cannot both be given"):
        ColumnParallelLinear(8, 32, tp=tp, blocks=(16, 16), stride=2, device="meta")


def test_stride_is_still_equal_blocks() -> None:
    """``stride=2`` and ``blocks=(n / 2, n / 2)`` are the same split."""
    tp = Group.single()
    a = ColumnParallelLinear(8, 24, tp=tp, stride=2, seed=3)
    b = ColumnParallelLinear(8, 24, tp=tp, blocks=(12, 12), seed=3)
    assert a.weight is not None and b.weight is not None
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    assert a.weight.partition_stride == 2 and not hasattr(a.weight, "partition_blocks")  # type: ignore[attr-defined]
    assert b.weight.partition_blocks == (12, 12)  # type: ignore[attr-defined]
