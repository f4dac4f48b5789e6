"""``parallel.tp_comm=p2p`` and ``parallel.dp_comm=p2p``: mcore's own peer-to-peer exchanges train exactly like one
process (CPU, gloo, the buffers in shared memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_parallel.testing import run_distributed
from mcore_train import pretrain
from tests.train._util import config


def _losses_and_exchanges(overrides: list[str]) -> tuple[list[float], int]:
    from mcore_parallel.tensor.p2p import PeerWorkspace

    real, calls = PeerWorkspace.next_slot, [0]

    def counted(self: PeerWorkspace) -> int:
        calls[0] += 1
        return real(self)

    PeerWorkspace.next_slot = counted  # type: ignore[method-assign]
    try:
        return pretrain(config(*overrides)).losses, calls[0]
    finally:
        PeerWorkspace.next_slot = real  # type: ignore[method-assign]


@pytest.mark.parametrize("extra", [[], ["parallel.gradient_accumulation_fusion=true"]], ids=["plain", "fused-wgrad"])
def test_p2p_exchange_trains_like_one_process(extra: list[str]) -> None:
    base = ["training.train_iters=3", "training.device=cpu", *extra]
    reference = pretrain(config(*base)).losses
    losses, exchanges = run_distributed(_losses_and_exchanges, 2, [*base, "parallel.tp=2",
                                        "parallel.sequence_parallel=true", "parallel.tp_comm=p2p"])[0]  # fmt: skip
    assert exchanges > 0  # the linears went through the exchange
    assert losses == pytest.approx(reference, abs=1e-5)


def _losses_and_p2p_reductions(overrides: list[str]) -> tuple[list[float], int]:
    from mcore_parallel.ddp.buffer import GradBuffer

    real, calls = GradBuffer._p2p_reduce, [0]

    def counted(self: GradBuffer, bucket: object) -> None:
        calls[0] += 1
        real(self, bucket)  # type: ignore[arg-type]

    GradBuffer._p2p_reduce = counted  # type: ignore[method-assign]
    try:
        return pretrain(config(*overrides)).losses, calls[0]
    finally:
        GradBuffer._p2p_reduce = real  # type: ignore[method-assign]


@pytest.mark.parametrize("distopt", [True, False], ids=["distributed-optimizer", "all-reduce"])
def test_p2p_data_parallel_exchange_trains_like_one_process(distopt: bool) -> None:
    base = ["training.train_iters=3", "training.device=cpu", "training.global_batch_size=8",
            f"optimizer.use_distributed_optimizer={str(distopt).lower()}"]  # fmt: skip
    reference = pretrain(config(*base)).losses
    losses, reductions = run_distributed(_losses_and_p2p_reductions, 2, [*base, "parallel.dp_comm=p2p"])[0]
    assert reductions > 0  # the gradient buckets were reduced peer to peer
    assert losses == pytest.approx(reference, abs=1e-5)


def _straight_and_resumed(overrides: list[str], tmp: str) -> tuple[list[float], list[float]]:
    straight = pretrain(config(*overrides, "training.train_iters=6", f"checkpoint.dir={tmp}/a")).losses
    first = pretrain(config(*overrides, "training.train_iters=6", "training.exit_interval=3",
                            f"checkpoint.dir={tmp}/b"))  # fmt: skip
    second = pretrain(config(*overrides, "training.train_iters=6", f"checkpoint.dir={tmp}/b"))
    return straight, first.losses + second.losses


def test_p2p_exchanges_resume_bit_exact(tmp_path: Path) -> None:
    """A checkpoint loads into the symmetric buffers of the p2p exchanges (the parameters are views of them): the
    resumed run continues bit for bit (tp2 + SP through the p2p exchange, dp2 with the distributed optimizer)."""
    overrides = ["training.device=cpu", "optimizer.use_distributed_optimizer=true", "parallel.dp_comm=p2p",
                 "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm=p2p"]  # fmt: skip
    straight, resumed = run_distributed(_straight_and_resumed, 4, overrides, str(tmp_path), timeout=300)[0]
    assert len(straight) == 6 and resumed == straight


def test_memory_stats_count_the_symmetric_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The p2p exchanges' buffers live outside PyTorch's allocator: the logged memory adds them (else dp2 through
    p2p would report 7.3 GB less than it uses for llama-1b)."""
    import torch

    from mcore_parallel.tensor import p2p
    from mcore_train.metrics import memory_stats

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    device = torch.device("cuda", 0)
    assert memory_stats(device) == {"mem_allocated_gib": 1.0, "mem_peak_gib": 3.0}
    monkeypatch.setitem(p2p._SYMMETRIC_BYTES, 0, 0)
    p2p._count(device, 2**29)  # a buffer made
    assert memory_stats(device) == {"mem_allocated_gib": 1.5, "mem_peak_gib": 3.5, "mem_symmetric_gib": 0.5}
    p2p._count(device, -(2**29))  # and released
    assert memory_stats(device) == {"mem_allocated_gib": 1.0, "mem_peak_gib": 3.0}
