"""Context parallelism through the real training loop (CPU, gloo, float32, the tiny Llama with grouped K/V): every
layout with cp > 1 trains like one process on the same global batches (the loss of every step), packed sequences
too, and a checkpoint
saved at cp2 resumes at cp1 with the loss continuing as in an uninterrupted cp1 run."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_parallel.testing import run_distributed
from mcore_train import ConfigError, pretrain
from tests.train._util import config

BASE = ["training.train_iters=3", "training.device=cpu", "data.seq_length=32", "model.num_query_groups=2",
        "model.max_position_embeddings=64"]  # fmt: skip


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(config(*BASE, *overrides)).losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    losses = _losses([])
    assert len(losses) == 3 and losses[0] != losses[-1]
    return losses


LAYOUTS = {
    "cp2": (2, ["parallel.cp=2", "parallel.cp_comm=p2p"]),
    "cp2-allgather": (2, ["parallel.cp=2", "parallel.cp_comm=allgather"]),
    "cp2-recompute": (2, ["parallel.cp=2", "model.recompute=full"]),
    "cp2-selective-recompute": (2, ["parallel.cp=2", "model.recompute=selective", "parallel.cp_comm=p2p"]),
    "cp4": (4, ["parallel.cp=4", "parallel.cp_comm=p2p"]),
    "cp4-allgather": (4, ["parallel.cp=4", "parallel.cp_comm=allgather"]),
    "cp2-tp2-sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "cp2-dp2-distopt": (4, ["parallel.cp=2", "optimizer.use_distributed_optimizer=true"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layouts_train_like_one_process(name: str, reference: list[float]) -> None:
    world, overrides = LAYOUTS[name]
    losses = run_distributed(_losses, world, overrides, timeout=300)
    for rank_losses in losses:  # every rank reports the same agreed loss
        assert rank_losses == pytest.approx(reference, rel=1e-5, abs=1e-6), name


PACKED = ["data.packing=true", "data.eod_mask_loss=true"]
PACKED_LAYOUTS = {
    "cp2": (2, ["parallel.cp=2", "parallel.cp_comm=p2p"]),
    "cp4-allgather": (4, ["parallel.cp=4", "parallel.cp_comm=allgather"]),
    "cp2-dp2-distopt": (4, ["parallel.cp=2", "optimizer.use_distributed_optimizer=true"]),
}


@pytest.fixture(scope="module")
def packed_reference(reference: list[float]) -> list[float]:
    losses = _losses(PACKED)
    assert losses[0] != pytest.approx(reference[0], abs=1e-6)  # the documents' mask changes what attention sees
    return losses


@pytest.mark.parametrize("name", list(PACKED_LAYOUTS))
def test_packed_sequences_at_cp_train_like_one_process(name: str, packed_reference: list[float]) -> None:
    """data.packing=true at cp > 1: each rank's chunks carry their document ids, the ring masks other documents
    with every rank's ids, and the loss of every step equals the packed one-process run (GQA K/V)."""
    world, overrides = PACKED_LAYOUTS[name]
    losses = run_distributed(_losses, world, [*PACKED, *overrides], timeout=300)
    for rank_losses in losses:
        assert rank_losses == pytest.approx(packed_reference, rel=1e-5, abs=1e-6), name


def _train(overrides: list[str]) -> list[float]:
    return pretrain(config(*BASE, "training.train_iters=4", *overrides)).losses


def test_a_cp2_checkpoint_resumes_at_cp1(tmp_path: Path) -> None:
    straight = _train([])
    ck = f"checkpoint.dir={tmp_path / 'run'}"
    first = run_distributed(_train, 2, ["parallel.cp=2", "training.exit_interval=2", ck], timeout=300)[0]
    second = _train([ck])
    assert len(first) == 2 and len(second) == 2
    assert [*first, *second] == pytest.approx(straight, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.cp=4", "data.seq_length=36"], "divisible by 2 x parallel.cp = 8"),
        (
            [
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "data.seq_length=36",
                "model.num_attention_heads=4",
                "model.num_query_groups=4",
            ],
            "seq_length / cp = 18 must be divisible by tp=4",
        ),
        (["parallel.cp=2", "model.attention_dropout=0.1"], "ring attention has no dropout"),
        (["parallel.cp=2", "parallel.cp_comm=ring"], "cp_comm"),
        (["parallel.cp=2", "model.moe.aux_loss_coeff=0.1"], "use global_aux_loss"),
    ],
)
def test_context_parallel_configuration_problems(overrides: list[str], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        config(*BASE, *overrides, world_size=8).check_layout(8)


def _eval_losses(overrides: list[str]) -> list[tuple[int, float]]:
    result = pretrain(config(*BASE, "training.train_iters=2", "training.eval_iters=2", *overrides))
    return result.eval_losses


def test_evaluation_at_cp2_equals_cp1() -> None:
    want = _eval_losses([])
    got = run_distributed(_eval_losses, 2, ["parallel.cp=2"], timeout=300)[0]
    assert want and [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_compiled_layers_at_cp2_train_like_compiled_cp1() -> None:
    """``training.compile=layers`` with ring attention inside each compiled layer."""
    want = _losses(["training.compile=layers"])
    got = run_distributed(_losses, 2, ["parallel.cp=2", "training.compile=layers"], timeout=500)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("extra", [[], ["parallel.ep=2"]], ids=["cp2", "cp2-ep2"])
def test_moe_with_the_global_aux_loss_at_cp2_trains_like_one_process(extra: list[str], tmp_path: Path) -> None:
    """moe-tiny (load-balancing and z-loss on) at cp2 with and without expert parallelism: losses, gradient norms,
    routing metrics."""
    from tests.train.test_moe import _records, assert_same

    balance = ["model.moe.load_balancing_type=global_aux_loss"]
    want = _records(balance, str(tmp_path / "one"))
    got = run_distributed(_records, 2, [*balance, "parallel.cp=2", *extra], str(tmp_path / "two"), timeout=300)[0]
    assert_same(got, want, "cp2 " + " ".join(extra))
