"""The multi-process harness itself: results in rank order, the first failing rank's traceback, no hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mcore_parallel.testing import DistributedFailure, run_distributed


def _rank_times_ten() -> int:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return dist.get_rank() * 10 + int(t.item())


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank one")
    dist.barrier()  # the other ranks hang here until the pool is torn down


def _hang_forever() -> None:
    time.sleep(1000)


def test_results_in_rank_order() -> None:
    assert run_distributed(_rank_times_ten, 4) == [6, 16, 26, 36]


def test_first_failing_rank_is_reraised_with_traceback() -> None:
    with pytest.raises(DistributedFailure) as exc:
        run_distributed(_fail_on_rank_one, 2, timeout=30)
    msg = str(exc.value)
    assert msg.startswith("rank 1 of 2 failed")
    assert "RuntimeError: boom from rank one" in msg and "_fail_on_rank_one" in msg
    # the pool is rebuilt afterwards
    assert run_distributed(_rank_times_ten, 2) == [1, 11]


def test_timeout_kills_a_hung_run() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish _hang_forever within 2 s"):
        run_distributed(_hang_forever, 2, timeout=2)
    assert time.monotonic() - start < 20
    assert run_distributed(_rank_times_ten, 2) == [1, 11]
