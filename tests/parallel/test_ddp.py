"""DDP against one process: bucket sizes and overlap on/off, tp2·dp2 with sequence parallelism, gradient accumulation
equal to one big batch, no reduction before the last micro-batch, fp32 ``main_grad`` for bf16 parameters."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.pipeline import forward_backward
from mcore_parallel.testing import run_distributed
from tests.parallel.test_pipeline_model import (
    HIDDEN,
    SEQ,
    Spec,
    assert_matches_reference,
    batches,
    build_chunks,
    forward_step,
)


@pytest.mark.parametrize(
    "bucket_size,overlap",
    [(200, True), (None, False), (1, True), (10**9, True), (300, False)],
    ids=["b200-overlap", "one-bucket-sync", "bucket-per-param", "huge-bucket", "b300-sync"],
)
def test_dp2_matches_single_process(bucket_size: int | None, overlap: bool) -> None:
    assert_matches_reference(Spec(micro=2, bucket_size=bucket_size, overlap=overlap), 2)


def test_tp2_dp2_sequence_parallel_matches_single_process() -> None:
    assert_matches_reference(Spec(tp=2, sp=True, micro=2), 4)


def test_tp2_dp2_sequence_parallel_untied_sync_reduce() -> None:
    assert_matches_reference(Spec(tp=2, sp=True, micro=2, tie=False, overlap=False, bucket_size=None), 4)


def _grads_after(micro: int, mbs: int, k: int, overlap: bool) -> dict[str, torch.Tensor]:
    """Main grads after one step of ``micro`` micro-batches of ``mbs`` samples, built from k samples per rank."""
    state = ParallelState.initialize(ParallelConfig())
    spec = Spec()
    chunks = [DistributedDataParallel(c, state, DDPConfig(bucket_size=100, overlap_grad_reduce=overlap))
              for c in build_chunks(state, spec)]  # fmt: skip
    samples = batches(0, state.dp.size * k, 1, seed=7)[state.dp.rank * k : (state.dp.rank + 1) * k]
    data = [
        (torch.cat([t for t, _ in samples[i : i + mbs]], 1), torch.cat([y for _, y in samples[i : i + mbs]], 1))
        for i in range(0, k, mbs)
    ]
    assert len(data) == micro
    forward_backward(forward_step, iter(data), chunks, micro, SEQ, mbs, HIDDEN, state)
    return {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}


@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_accumulation_equals_one_big_batch(overlap: bool) -> None:
    accumulated = run_distributed(_grads_after, 2, 4, 2, 8, overlap)
    big = run_distributed(_grads_after, 2, 1, 8, 8, overlap)
    for a, b in zip(accumulated, big):
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    for n in accumulated[0]:  # data-parallel ranks agree
        torch.testing.assert_close(accumulated[0][n], accumulated[1][n], rtol=0, atol=0)


def _no_sync_then_sync() -> dict[str, object]:
    state = ParallelState.initialize(ParallelConfig())
    model = DistributedDataParallel(build_chunks(state, Spec(tie=False))[0], state, DDPConfig(bucket_size=50))
    model_params = list(model.module.parameters())
    data = batches(3, 4, 2, seed=5)[2 * state.dp.rank : 2 * state.dp.rank + 2]

    def loss(i: int) -> torch.Tensor:
        return model(data[i][0]).float().square().mean()

    with model.no_sync():
        loss(0).backward()
    after_first = [p.main_grad.clone() for p in model_params]
    started = [b.started for buf in model.grad_buffers for b in buf.buckets]
    grads_freed = all(p.grad is None for p in model_params)
    loss(1).backward()
    launched = [b.started for buf in model.grad_buffers for b in buf.buckets]
    model.finish_grad_sync()
    return dict(
        after_first=after_first, final=[p.main_grad.clone() for p in model_params], started=started,
        launched=launched, grads_freed=grads_freed, dtypes={p.main_grad.dtype for p in model_params},
    )  # fmt: skip


def test_no_sync_defers_reduction_until_last_microbatch() -> None:
    a, b = run_distributed(_no_sync_then_sync, 2)
    assert not any(a["started"]), "a bucket was reduced inside no_sync()"
    assert all(a["launched"]), "with overlap every bucket should launch from the backward hook"
    assert a["grads_freed"] and a["dtypes"] == {torch.float32}
    assert any(not torch.equal(x, y) for x, y in zip(a["after_first"], b["after_first"])), "grads reduced too early"
    for x, y in zip(a["final"], b["final"]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _bf16_main_grad() -> tuple[set, set, bool]:
    state = ParallelState.initialize(ParallelConfig())
    model = DistributedDataParallel(build_chunks(state, Spec(dtype="bfloat16"))[0], state)
    tokens, _ = batches(0, 1, 2, seed=1)[0]
    model(tokens).float().square().mean().backward()
    model.finish_grad_sync()
    ps = list(model.module.parameters())
    return {p.dtype for p in ps}, {p.main_grad.dtype for p in ps}, all(p.grad is None for p in ps)


def test_bf16_params_accumulate_in_fp32_main_grad() -> None:
    param_dtypes, grad_dtypes, freed = run_distributed(_bf16_main_grad, 2)[0]
    assert param_dtypes == {torch.bfloat16} and grad_dtypes == {torch.float32} and freed


def test_bf16_training_tracks_fp32_reference() -> None:
    """bf16 params with fp32 master weights, dp2: losses stay within bf16 rounding of the fp32 run."""
    outs = run_distributed(_bf16_losses, 2)
    ref = run_distributed(_bf16_losses, 1, "float32", 4)[0]
    got = [x for s in range(3) for o in outs for x in o[2 * s : 2 * s + 2]]  # per step: rank 0's, then rank 1's
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-2, atol=2e-2)


def _bf16_losses(dtype: str = "bfloat16", micro: int = 2) -> list[float]:
    from tests.parallel.test_pipeline_model import setup, train_step

    spec = Spec(dtype=dtype, micro=micro, steps=1, optimizer=dict(optimizer="adam", lr=1e-2, clip_grad=1.0))
    state, chunks, opt = setup(spec)
    losses = []
    for step in range(3):
        loss, result = train_step(state, chunks, opt, spec, step)
        assert result.success
        losses += loss
    assert all(m.dtype == torch.float32 for m in opt.master_params())
    return losses
