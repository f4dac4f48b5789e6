"""Pipeline schedules against the one-process run: 1F1B, interleaved 1F1B, forward-only, tied embeddings, TP inside
stages, and a deadlocked schedule that fails with a message instead of hanging.

Every case trains the tiny model of ``test_pipeline_model`` for a few steps (fp32, SGD) and compares losses, grad
norms and updated parameters with the same training in one process.
"""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.pipeline import (
    P2PCommunicator,
    PipelineTimeoutError,
    forward_backward,
    sync_shared_embedding_weights,
)
from mcore_parallel.testing import DistributedFailure, run_distributed
from tests.parallel.test_pipeline_model import (
    HIDDEN,
    SEQ,
    Spec,
    assert_matches_reference,
    batches,
    build_chunks,
    forward_step,
    merge_params,
    step_losses,
    train,
)

CASES = {
    "pp2-m3": (Spec(pp=2, micro=3), 2),
    "pp4-tied": (Spec(pp=4, micro=5), 4),
    "pp4-untied-m4": (Spec(pp=4, micro=4, tie=False), 4),
    "pp2xvpp2-m4": (Spec(pp=2, vpp=2, micro=4), 2),
    "pp2xvpp2-m2-allwarmup": (Spec(pp=2, vpp=2, micro=2), 2),
    "pp2xvpp3-m6": (Spec(pp=2, vpp=3, layers=6, micro=6), 2),
    "pp4xvpp2-m8": (Spec(pp=4, vpp=2, layers=8, micro=8, steps=2), 4),
    "tp2-pp2-dp2": (Spec(tp=2, pp=2, micro=3), 8),
    "tp2-pp2-dp2-sp-vpp2": (Spec(tp=2, pp=2, vpp=2, sp=True, micro=2, steps=2), 8),
    "tp4-dp2-sp": (Spec(tp=4, sp=True, micro=2, steps=2), 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_process(name: str) -> None:
    spec, world = CASES[name]
    assert_matches_reference(spec, world)


def test_interleaved_equals_non_interleaved() -> None:
    a = run_distributed(train, 2, Spec(pp=2, vpp=1, micro=4))
    b = run_distributed(train, 2, Spec(pp=2, vpp=2, micro=4))
    torch.testing.assert_close(torch.tensor(step_losses(a)), torch.tensor(step_losses(b)), rtol=1e-6, atol=1e-6)
    pa, pb = merge_params(a), merge_params(b)
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-6, atol=1e-7)


def _forward_only(pp: int, vpp: int) -> list[float]:
    spec = Spec(pp=pp, vpp=vpp, micro=4)
    state = ParallelState.initialize(ParallelConfig(pp=pp, vpp=vpp if vpp > 1 else None))
    chunks = build_chunks(state, spec)
    sync_shared_embedding_weights(chunks, state)
    before = [p.detach().clone() for c in chunks for p in c.parameters()]
    data = batches(0, 4, spec.mbs, spec.seed)
    out = forward_backward(
        forward_step, [iter(data) for _ in chunks], chunks, 4, SEQ, spec.mbs, HIDDEN, state, forward_only=True
    )
    assert all(p.grad is None for c in chunks for p in c.parameters()), "forward_only must not produce gradients"
    assert all(torch.equal(a, p) for a, p in zip(before, (p for c in chunks for p in c.parameters())))
    return [r["loss"].item() for r in out]


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (2, 2)])
def test_forward_only_losses_match_training_forward(pp: int, vpp: int) -> None:
    outs = run_distributed(_forward_only, pp, pp, vpp)
    ref = run_distributed(train, 1, Spec(micro=4, steps=1))[0]["losses"][0]  # losses are computed before the step
    assert outs[-1] == pytest.approx(ref, rel=1e-6, abs=1e-7)
    assert all(o == [] for o in outs[:-1])  # only the last stage reports


def _bad_microbatches() -> str:
    state = ParallelState.initialize(ParallelConfig(pp=2, vpp=2))
    chunks = build_chunks(state, Spec(pp=2, vpp=2))
    try:
        forward_backward(forward_step, None, chunks, 3, SEQ, 2, HIDDEN, state)
    except ValueError as e:
        return str(e)
    return "no error"


def test_interleaved_needs_multiple_of_pp() -> None:
    msgs = run_distributed(_bad_microbatches, 2)
    assert "num_microbatches (3) to be a multiple of pp (2)" in msgs[0] and "use 4" in msgs[0]


def _stage_never_sends() -> None:
    """A broken schedule: stage 0 skips its send, so stage 1 waits for an activation that never comes."""
    state = ParallelState.initialize(ParallelConfig(pp=2))
    p2p = P2PCommunicator(state, (SEQ, 2, HIDDEN), torch.float32, timeout=1.0)
    p2p.context = "forward of micro-batch 0, chunk 0"
    if state.is_first_stage:
        return  # never sends
    p2p.recv_forward()


def test_deadlock_raises_with_stage_and_microbatch() -> None:
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_stage_never_sends, 2, timeout=30)
    msg = str(info.value)
    assert PipelineTimeoutError.__name__ in msg
    assert "pipeline stage 1" in msg and "forward of micro-batch 0, chunk 0" in msg and "recv from rank 0" in msg


def _hang() -> None:
    state = ParallelState.initialize(ParallelConfig(pp=2))
    if state.is_last_stage:  # the last stage waits forever for a gradient nobody sends, with no p2p timeout
        P2PCommunicator(state, (SEQ, 2, HIDDEN), torch.float32).communicate(recv_prev=True)


def test_hung_schedule_fails_by_harness_timeout() -> None:
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_hang, 2, timeout=3)
