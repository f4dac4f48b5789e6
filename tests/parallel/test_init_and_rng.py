"""TP-size-independent initialisation and the TP-aware RNG tracker."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    derive_seed,
    model_parallel_seed,
)
from mcore_parallel.tensor._comm import all_gather
from mcore_parallel.testing import run_distributed


def _build(tp: Group, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    col = ColumnParallelLinear(12, 16, tp=tp, seed=derive_seed(5, "col"), dtype=dtype)
    row = RowParallelLinear(16, 12, tp=tp, seed=derive_seed(5, "row"), dtype=dtype)
    emb = VocabParallelEmbedding(100, 12, tp=tp, seed=derive_seed(5, "emb"), dtype=dtype)
    return {
        "col": all_gather(col.weight.detach(), tp, 0),
        "row": all_gather(row.weight.detach(), tp, 1),
        "emb": all_gather(emb.weight.detach(), tp, 0),
    }


def _init_matches_tp1(tp: int, dtype: torch.dtype) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    sharded = _build(state.tp, dtype)
    single = _build(Group.single(), dtype)
    assert torch.equal(sharded["col"], single["col"])
    assert torch.equal(sharded["row"], single["row"])
    assert torch.equal(sharded["emb"][:100], single["emb"][:100])
    assert torch.all(sharded["emb"][100:] == 0)
    assert sharded["emb"].shape[0] == 128 * tp


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unsharded_weight_is_identical_for_every_tp(tp: int, dtype: torch.dtype) -> None:
    run_distributed(_init_matches_tp1, tp, tp, dtype)


def test_seeds_differ_per_name_and_are_stable() -> None:
    a = ColumnParallelLinear(8, 8, tp=Group.single(), seed=derive_seed(1, "a"))
    b = ColumnParallelLinear(8, 8, tp=Group.single(), seed=derive_seed(1, "b"))
    a2 = ColumnParallelLinear(8, 8, tp=Group.single(), seed=derive_seed(1, "a"))
    assert not torch.equal(a.weight, b.weight) and torch.equal(a.weight, a2.weight)
    expected = int.from_bytes(hashlib.sha256(b"1:a").digest()[:8], "little") & ((1 << 63) - 1)
    assert derive_seed(1, "a") == expected
    assert abs(a.weight.std().item() - 0.02) < 0.01


def test_meta_device_allocates_nothing() -> None:
    layer = ColumnParallelLinear(1 << 14, 1 << 14, tp=Group.single(), device="meta", seed=1)
    assert layer.weight.is_meta and layer.weight.shape == (1 << 14, 1 << 14)


def _dropout_masks(tp: int) -> dict[str, torch.Tensor]:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    tracker = model_parallel_seed(1234, tp_rank=state.tp.rank, pp_rank=state.pp.rank)
    x = torch.ones(64, 32)
    replicated = torch.nn.functional.dropout(x, 0.5)
    with tracker.fork():
        parallel = torch.nn.functional.dropout(x, 0.5)
    after = torch.nn.functional.dropout(x, 0.5)
    masks = {"replicated": replicated, "parallel": parallel, "after": after}
    return {k: all_gather(v.unsqueeze(0), state.tp, 0) for k, v in masks.items()}


def _reference_masks() -> dict[str, torch.Tensor]:
    model_parallel_seed(1234)  # a TP=1 run: the same default stream, no fork in between
    x = torch.ones(64, 32)
    return {"replicated": torch.nn.functional.dropout(x, 0.5), "after": torch.nn.functional.dropout(x, 0.5)}


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_masks_follow_megatron(tp: int) -> None:
    ref = _reference_masks()
    gathered = run_distributed(_dropout_masks, tp, tp)[0]
    for r in range(tp):
        # TP-replicated regions: every rank draws the TP=1 mask
        assert torch.equal(gathered["replicated"][r], ref["replicated"])
        # forking the model-parallel stream does not disturb the default stream
        assert torch.equal(gathered["after"][r], ref["after"])
    # model-parallel regions: a different mask on every rank
    masks = [gathered["parallel"][r] for r in range(tp)]
    for i in range(tp):
        for j in range(i + 1, tp):
            assert not torch.equal(masks[i], masks[j])


def test_tracker_state_round_trip_and_errors() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 10)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 11)
    with pytest.raises(ValueError, match="seed 10 is already used"):
        tracker.add("b", 10)
    with pytest.raises(KeyError, match="never added"), tracker.fork("zzz"):
        pass
    saved = tracker.state_dict()
    with tracker.fork("a"):
        first = torch.rand(5)
    tracker.load_state_dict(saved)
    with tracker.fork("a"):
        again = torch.rand(5)
    assert torch.equal(first, again)
    assert not dist.is_initialized()
