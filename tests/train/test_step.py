"""The loop's pieces on their own: ``train_step`` (one optimizer step, its values read lazily) and the metrics window
(the log record of the steps between two log lines)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mcore_parallel.optim import StepResult
from mcore_train import loop, step
from mcore_train.metrics import MetricsWindow
from mcore_train.step import StepOutcome, deferred_reads, train_step
from mcore_train.trainer import setup

from ._util import config

FUSED = ["optimizer.fused=true", "training.device=cpu"]


class _Clock:
    """Every window lasts ``seconds``; records the end events it was given."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ends = seconds, []

    def lap(self, end: Any) -> float:
        self.ends.append(end)
        return self.seconds


def _outcome(n: int, loss: float, *, batch: int = 8, seq: int = 16, norm: float = 1.5, zeros: float = 3.0,
             update: StepResult | None = None, data: float = 0.0, images: int = 0) -> StepOutcome:  # fmt: skip
    update = update if update is not None else StepResult(True, None, None, None)
    values = torch.tensor([loss * 2, 0.0, 0.0, norm, zeros], dtype=torch.float64)  # the loss sum over dp=2 ranks
    return StepOutcome(step=n, lr=0.1 * n, global_batch=batch, tokens=batch * seq, samples_before=(n - 1) * batch,
                       tokens_after=n * batch * seq, logged=True, update=update, end=f"end-{n}", values=values,
                       ready=None, dp_size=2, data_seconds=data, images=images)  # fmt: skip


def test_the_metrics_window_averages_counts_and_starts_again() -> None:
    clock = _Clock(2.0)
    window = MetricsWindow(clock, flops_per_token=1e9, world_size=4, peak_tflops=0.5, device=torch.device("cpu"))
    window.add(_outcome(1, 2.0, data=0.1))
    window.add(_outcome(2, math.nan, data=0.2))  # a skipped step: its tokens count, its loss does not
    window.add(_outcome(3, 4.0, batch=16, data=0.3))
    record = window.close(_outcome(3, 4.0, batch=16), skipped_steps=1)
    tokens = (8 + 8 + 16) * 16
    assert record["loss"] == pytest.approx(3.0)
    assert record["tokens_per_s"] == pytest.approx(tokens / 2.0)
    assert record["samples_per_s"] == pytest.approx(32 / 2.0)
    assert record["tflops_per_gpu"] == pytest.approx(tokens / 2.0 * 1e9 / 4 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_gpu"] / 0.5)
    assert (record["lr"], record["grad_norm"], record["num_zeros"], record["loss_scale"]) == (pytest.approx(0.3), 1.5,
                                                                                             3, None)  # fmt: skip
    assert (record["global_batch_size"], record["consumed_tokens"], record["skipped_steps"]) == (16, 3 * 16 * 16, 1)
    assert list(record) == ["loss", "lr", "grad_norm", "num_zeros", "loss_scale", "tokens_per_s", "samples_per_s",
                            "tflops_per_gpu", "data_ms_per_step", "data_share", "global_batch_size",
                            "consumed_tokens", "skipped_steps", "mem_rss_peak_gib", "mfu"]  # fmt: skip
    # the data loader's host time: per step, and as a share of the window's 2 s
    assert record["data_ms_per_step"] == pytest.approx(200.0) and record["data_share"] == pytest.approx(0.3)
    assert clock.ends == ["end-3"]  # timed to the end of the window's last step
    # the next window starts empty: only its own step, flagged when it ran under the profiler
    window.add(_outcome(4, 5.0), profiled=True)
    record = window.close(_outcome(4, 5.0, norm=math.nan, zeros=math.nan), skipped_steps=1)
    assert record["loss"] == pytest.approx(5.0) and record["tokens_per_s"] == pytest.approx(8 * 16 / 2.0)
    assert record["profiled"] is True and record["grad_norm"] is None and record["num_zeros"] is None
    window.add(_outcome(5, 6.0))
    assert "profiled" not in window.close(_outcome(5, 6.0), skipped_steps=1)


def test_the_metrics_window_counts_the_images_of_a_vlm() -> None:
    """A VLM's FLOPs: the LM's per token plus the tower's per image read, times the data-parallel ranks."""
    window = MetricsWindow(_Clock(2.0), flops_per_token=1e9, world_size=4, peak_tflops=None, device=torch.device("cpu"),
                           flops_per_image=5e10, image_scale=2)  # fmt: skip
    window.add(_outcome(1, 2.0, images=3))
    window.add(_outcome(2, 2.0, images=5))
    record = window.close(_outcome(2, 2.0), skipped_steps=0)
    assert record["tflops_per_gpu"] == pytest.approx((2 * 8 * 16 * 1e9 + 8 * 2 * 5e10) / 2.0 / 4 / 1e12)


def _train_losses(overrides: list[str]) -> list[float]:
    return loop.train(setup(config(*overrides))).losses


@pytest.mark.parametrize("mode", ["deferred", "read_every_step"])
def test_train_step_used_directly_trains_like_train(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    overrides = ["training.train_iters=4", *FUSED]
    if mode == "read_every_step":
        overrides.append("training.read_loss_every_step=true")
    reference = _train_losses(overrides)
    run = setup(config(*overrides))
    assert deferred_reads(run) == (mode == "deferred")
    reads: list[int] = []
    read = step._read_host
    monkeypatch.setattr(step, "_read_host", lambda values, ready: reads.append(1) or read(values, ready))
    iterators = run.train_iterators()
    outcomes = [train_step(run, iterators) for _ in range(4)]
    assert reads == []  # nothing read on the host until the values are asked for
    assert [o.loss for o in outcomes] == reference  # bit for bit
    assert not any(o.skipped or o.stop_requested for o in outcomes) and len(reads) == 4  # each read once
    assert all(math.isfinite(o.grad_norm) and o.num_zeros is not None for o in outcomes)
    assert [o.step for o in outcomes] == [1, 2, 3, 4] and run.step == 4
    assert run.consumed_samples == 4 * 8 and run.consumed_tokens == outcomes[-1].tokens_after == 4 * 8 * 16


def test_a_stop_vote_is_asked_after_the_backward_and_agreed(monkeypatch: pytest.MonkeyPatch) -> None:
    run = setup(config("training.train_iters=2", *FUSED))
    calls: list[str] = []
    schedule = step._schedule_loss

    def scheduled(*args: Any) -> Any:
        calls.append("schedule")
        return schedule(*args)

    monkeypatch.setattr(step, "_schedule_loss", scheduled)

    def vote(answer: bool) -> Any:
        def ask() -> bool:
            calls.append("vote")
            return answer

        return ask

    iterators = run.train_iterators()
    first = train_step(run, iterators, stop_vote=vote(False))
    second = train_step(run, iterators, stop_vote=vote(True))
    assert calls == ["schedule", "vote", "schedule", "vote"]
    assert not first.stop_requested and second.stop_requested
