"""Shard descriptions put every rank's piece where it belongs in the global tensor (strides, vocab padding)."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, derive_seed
from mcore_parallel.testing import run_distributed


def _layers(tp: Group) -> dict[str, torch.nn.Parameter]:
    gated = ColumnParallelLinear(8, 24, tp=tp, stride=2, seed=derive_seed(3, "gated"))
    out = ColumnParallelLinear(8, 256 * tp.size, tp=tp, bias=False, pad_rows=256 * tp.size - 100, seed=3)
    row = RowParallelLinear(24, 8, tp=tp, seed=derive_seed(3, "row"))
    emb = VocabParallelEmbedding(100, 8, tp=tp, seed=derive_seed(3, "emb"))
    return {
        "gated.weight": gated.weight,
        "gated.bias": gated.bias,
        "out.weight": out.weight,
        "row.weight": row.weight,
        "row.bias": row.bias,
        "emb.weight": emb.weight,
    }


def _reassemble(tp_size: int) -> dict[str, torch.Tensor]:
    state = ParallelState.initialize(ParallelConfig(tp=tp_size))
    out = {}
    for key, param in _layers(state.tp).items():
        info = shard_info(key, param.detach(), state.tp, like=param)
        full = torch.full(info.global_shape, float("nan"))
        info.scatter_into(full)
        mask = (~full.isnan()).float()
        parts, masks = [full.nan_to_num()], [mask]
        if state.tp.size > 1:
            parts = [torch.zeros_like(full) for _ in range(state.tp.size)]
            masks = [torch.zeros_like(mask) for _ in range(state.tp.size)]
            torch.distributed.all_gather(parts, full.nan_to_num(), group=state.tp.pg)
            torch.distributed.all_gather(masks, mask, group=state.tp.pg)
        replicated = info.replica or not getattr(param, "tensor_model_parallel", False)
        if not replicated:
            assert torch.all(sum(masks) == 1), f"{key}: every global element is owned by exactly one rank"
        out[key] = parts[0] if replicated else sum(parts)
        # load_from puts the same values back
        before = param.detach().clone()
        with torch.no_grad():
            param.zero_()
        info.load_from(out[key])
        assert torch.equal(param.detach(), before), key
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_global_tensors_equal_tp1(tp: int) -> None:
    single = _reassemble(1)
    sharded = run_distributed(_reassemble, tp, tp)[0]
    for key in single:
        assert single[key].shape == sharded[key].shape, key
        assert torch.equal(single[key], sharded[key]), key
    assert single["out.weight"].shape == (100, 8) and single["gated.weight"].shape == (24, 8)
