"""The loop without a host sync per step: with an optimizer that skips non-finite steps on the device (fused AdamW,
here on the CPU through ``optimizer.fused=true``), a step's loss is read only after the next step is enqueued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_parallel.checkpoint import latest_checkpoint, read_metadata
from mcore_parallel.optim import MixedPrecisionOptimizer
from mcore_parallel.testing import run_distributed
from mcore_train import TrainingDiverged, loop, step
from mcore_train.api import pretrain
from mcore_train.trainer import setup

from ._util import config, nan_at_step

FUSED = ["optimizer.fused=true", "training.device=cpu"]


def _events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records ("launch", n) when the n-th training schedule is enqueued and ("read", n) when the host reads the
    n-th step's values (its agreed loss)."""
    events: list[tuple[str, int]] = []
    launch, read = step._schedule_loss, step._read_host

    def launched(run, iterators, num_micro, forward_only):  # type: ignore[no-untyped-def]
        if not forward_only:
            events.append(("launch", sum(e == "launch" for e, _ in events) + 1))
        return launch(run, iterators, num_micro, forward_only)

    def reads(values, ready):  # type: ignore[no-untyped-def]
        events.append(("read", sum(e == "read" for e, _ in events) + 1))
        return read(values, ready)

    monkeypatch.setattr(step, "_schedule_loss", launched)
    monkeypatch.setattr(step, "_read_host", reads)
    return events


def _force_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MixedPrecisionOptimizer, "skips_on_device", property(lambda self: False))


def _params(overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    run = setup(config(*overrides))
    result = loop.train(run)
    return result.losses, {k: v.detach().clone() for k, v in run.chunks[0].state_dict().items()}


def test_the_host_reads_each_loss_after_enqueuing_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _events(monkeypatch)
    pretrain(config("training.train_iters=4", *FUSED))
    assert events == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("launch", 4),
                      ("read", 3), ("read", 4)]  # fmt: skip
    events.clear()
    pretrain(config("training.train_iters=2", "training.read_loss_every_step=true", *FUSED))
    assert events == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2)]
    events.clear()
    _force_host_sync(monkeypatch)  # the foreach kernel, fp16 or SGD: each loss is read before its update
    pretrain(config("training.train_iters=2", *FUSED))
    assert events == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2)]


class _DeviceEvent:
    """A timing event stamped with a simulated device clock (the time its stream reaches it)."""

    def __init__(self, now: float) -> None:
        self.t = now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _DeviceEvent) -> float:
        return (other.t - self.t) * 1e3


@pytest.mark.parametrize("mode", ["deferred", "read_every_step"])
def test_logged_throughput_is_timed_between_step_ends_on_the_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str
) -> None:
    """Each training step takes 2 s of (simulated) device time while the host races ahead: the logged tokens/s must
    be the tokens over the device's time between step ends, whatever the host's clock says when it reads a step."""
    device = {"now": 0.0}
    monkeypatch.setattr(step, "_timed_on_device", lambda dev: True)
    monkeypatch.setattr(step, "_mark_end", lambda: _DeviceEvent(device["now"]))
    schedule = step._schedule_loss

    def step_takes_two_seconds(run, iterators, num_micro, forward_only):  # type: ignore[no-untyped-def]
        if not forward_only:
            device["now"] += 2.0
        return schedule(run, iterators, num_micro, forward_only)

    monkeypatch.setattr(step, "_schedule_loss", step_takes_two_seconds)
    extra = ["training.read_loss_every_step=true"] if mode == "read_every_step" else []
    pretrain(config("training.train_iters=6", "logging.log_interval=2", f"logging.dir={tmp_path}", *FUSED, *extra))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    assert rates == pytest.approx([8 * 16 / 2.0] * 4)  # global batch 8 x seq 16 tokens per 2 s step, each window
    assert [r["step"] for r in records if "tokens_per_s" in r] == [1, 2, 4, 6]  # step 1 too: the first interval


def test_deferred_reads_change_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    lagged, lagged_params = _params(["training.train_iters=5", *FUSED])
    _force_host_sync(monkeypatch)
    synced, synced_params = _params(["training.train_iters=5", *FUSED])
    assert lagged == synced and len(lagged) == 5
    for name, value in synced_params.items():
        torch.testing.assert_close(lagged_params[name], value, rtol=0, atol=0, msg=name)


def test_a_nan_step_is_dropped_on_the_device_like_the_host_drops_it(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    """The fused kernel leaves weights, moments and Adam's step count alone (the later steps' bias corrections
    would differ otherwise): the run ends with the same weights as when the host never called the update."""
    nan_at_step(monkeypatch, 3)
    common = ["training.train_iters=6", "training.on_nan=skip", *FUSED]
    lagged, lagged_params = _params([*common, f"checkpoint.dir={tmp_path / 'a'}"])
    assert read_metadata(latest_checkpoint(tmp_path / "a"))["skipped_steps"] == 1
    nan_at_step(monkeypatch, 3)
    _force_host_sync(monkeypatch)
    synced, synced_params = _params(common)
    assert len(lagged) == 5 and lagged == synced
    for name, value in synced_params.items():
        torch.testing.assert_close(lagged_params[name], value, rtol=0, atol=0, msg=name)


def test_a_nan_loss_still_stops_naming_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    nan_at_step(monkeypatch, 3)
    with pytest.raises(TrainingDiverged, match="the loss is nan at step 3"):
        pretrain(config("training.train_iters=6", *FUSED))


def test_a_stop_vote_ends_the_run_one_step_later(tmp_path: Path) -> None:
    """The time limit trips during step 1; its vote is read while step 2 runs, so the run saves after step 2."""
    timed = pretrain(config("training.train_iters=1000", "training.exit_duration_minutes=0.00001",
                            f"checkpoint.dir={tmp_path}", *FUSED))  # fmt: skip
    assert timed.exit_reason == "time_limit" and timed.steps == 2 and len(timed.losses) == 2
    meta = read_metadata(latest_checkpoint(tmp_path))
    assert meta["reason"] == "time_limit" and meta["step"] == 2


def test_intervals_read_the_pending_step_first(tmp_path: Path) -> None:
    """A checkpoint, an evaluation or an exit interval sees its step's bookkeeping done (skipped steps, logs)."""
    result = pretrain(config("training.train_iters=6", "checkpoint.save_interval=2", "training.exit_interval=3",
                             "training.eval_interval=2", "training.eval_iters=1", f"checkpoint.dir={tmp_path}",
                             *FUSED))  # fmt: skip
    assert result.exit_reason == "exit_interval" and result.steps == 3 and len(result.losses) == 3
    assert [s for s, _ in result.eval_losses] == [2]
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in metrics) == 3  # steps 1, 2 and 3 were logged before the exit


def _dp_losses(overrides: list[str]) -> list[float]:
    return pretrain(config(*overrides)).losses


def test_deferred_reads_under_data_and_tensor_parallelism() -> None:
    """dp2 (distributed optimizer), tp2 and pp2: the deferred loop gives the one-process losses on every rank."""
    reference = _dp_losses(["training.train_iters=3", "training.device=cpu"])
    for layout in (["optimizer.use_distributed_optimizer=true"], ["parallel.tp=2"], ["parallel.pp=2"]):
        out = run_distributed(_dp_losses, 2, ["training.train_iters=3", *FUSED, *layout], timeout=300)
        assert out[0] == out[1]
        assert out[0] == pytest.approx(reference, abs=1e-5), layout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_deferred_loop_trains_like_reading_every_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned-memory read-back and the device-side skip on a GPU: a nan step dropped, the same losses."""
    common = ["training.train_iters=5", "training.device=cuda", "training.on_nan=skip"]
    nan_at_step(monkeypatch, 2)
    run = setup(config(*common))
    assert run.optimizer.skips_on_device  # fused AdamW is the default on CUDA
    lagged = loop.train(run)
    nan_at_step(monkeypatch, 2)
    _force_host_sync(monkeypatch)
    synced = loop.train(setup(config(*common)))
    assert len(lagged.losses) == 4 and run.skipped_steps == 1
    assert lagged.losses == pytest.approx(synced.losses, abs=1e-3)
