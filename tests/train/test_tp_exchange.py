"""``parallel.tp_comm=p2p`` and ``parallel.dp_comm=p2p``: mcore's own peer-to-peer exchanges train exactly like one
process (CPU, gloo, the buffers in shared memory)."""

from __future__ import annotations

import pytest

from mcore_parallel.testing import run_distributed
from mcore_train import pretrain
from tests.train._util import config


def _losses_and_exchanges(overrides: list[str]) -> tuple[list[float], int]:
    from mcore_parallel.tensor import mappings

    losses = pretrain(config(*overrides)).losses
    exchanges = [e.workspace.exchanges for e in mappings._SYMMETRIC_GROUPS.values() if e.workspace is not None]
    return losses, sum(exchanges)


@pytest.mark.parametrize("extra", [[], ["parallel.gradient_accumulation_fusion=true"]], ids=["plain", "fused-wgrad"])
def test_p2p_exchange_trains_like_one_process(extra: list[str]) -> None:
    base = ["training.train_iters=3", "training.device=cpu", *extra]
    reference = pretrain(config(*base)).losses
    losses, exchanges = run_distributed(_losses_and_exchanges, 2, [*base, "parallel.tp=2",
                                        "parallel.sequence_parallel=true", "parallel.tp_comm=p2p"])[0]  # fmt: skip
    assert exchanges > 0  # the linears went through the exchange
    assert losses == pytest.approx(reference, abs=1e-5)


def _losses_and_p2p_buffers(overrides: list[str]) -> tuple[list[float], int]:
    from mcore_train.trainer import setup

    run = setup(config(*overrides))
    p2p = sum(buf.p2p for d in run.ddp for buf in d.grad_buffers)
    return pretrain(config(*overrides)).losses, p2p


@pytest.mark.parametrize("distopt", [True, False], ids=["distributed-optimizer", "all-reduce"])
def test_p2p_data_parallel_exchange_trains_like_one_process(distopt: bool) -> None:
    base = ["training.train_iters=3", "training.device=cpu", "training.global_batch_size=8",
            f"optimizer.use_distributed_optimizer={str(distopt).lower()}"]  # fmt: skip
    reference = pretrain(config(*base)).losses
    losses, p2p = run_distributed(_losses_and_p2p_buffers, 2, [*base, "parallel.dp_comm=p2p"])[0]
    assert p2p > 0  # the gradient buffers exchange peer to peer
    assert losses == pytest.approx(reference, abs=1e-5)
