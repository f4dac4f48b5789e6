"""Exact resume, resharding across layouts, SIGTERM handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcore_parallel.checkpoint import latest_checkpoint, read_metadata, read_region
from mcore_parallel.testing import run_distributed
from mcore_train import pretrain
from tests.train._util import TINY_MODEL, config, nan_at_step


def arrays(ckpt: Path) -> list[Path]:
    """Every array (not group) of a checkpoint, relative to it."""
    found = [p.parent for p in ckpt.glob("**/zarr.json") if json.loads(p.read_text())["node_type"] == "array"]
    return sorted(p.relative_to(ckpt) for p in found)


DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "scheduler.decay_iters=20"]


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    straight = pretrain(config(*DROPOUT, "training.train_iters=20", f"checkpoint.dir={tmp_path / 'a'}"))
    first = pretrain(config(*DROPOUT, "training.train_iters=20", "training.exit_interval=10",
                            f"checkpoint.dir={tmp_path / 'b'}"))  # fmt: skip
    assert first.exit_reason == "exit_interval" and first.steps == 10
    assert read_metadata(latest_checkpoint(tmp_path / "b"))["step"] == 10
    second = pretrain(config(*DROPOUT, "training.train_iters=20", f"checkpoint.dir={tmp_path / 'b'}"))
    assert first.losses + second.losses == straight.losses  # bit for bit: data order, LR, RNG, optimizer
    a, b = latest_checkpoint(tmp_path / "a"), latest_checkpoint(tmp_path / "b")
    assert arrays(a) == arrays(b) and len(arrays(a)) > 10
    for array in arrays(a):
        assert torch.equal(read_region(a / array), read_region(b / array)), array


LAYOUTS = {
    "tp2pp2dp2": (8, ["parallel.tp=2", "parallel.pp=2"]),
    "tp1pp1dp1": (1, []),
    "tp1pp2dp4": (8, ["parallel.pp=2", "training.micro_batch_size=1"]),
    "tp4": (4, ["parallel.tp=4"]),
    "pp2vpp2dp2-zero": (4, ["parallel.pp=2", "parallel.vpp=2", "optimizer.use_distributed_optimizer=true"]),
}


def _run(overrides: list[str]) -> list[float]:
    return pretrain(config(*overrides)).losses


def _in_layout(name: str, overrides: list[str]) -> list[float]:
    world, layout = LAYOUTS[name]
    args = [*layout, "scheduler.decay_iters=10", *overrides]
    return run_distributed(_run, world, args, timeout=300)[0] if world > 1 else _run(args)


def test_reshard_across_layouts(tmp_path: Path) -> None:
    zero = ["optimizer.use_distributed_optimizer=true"]
    orig = tmp_path / "orig"
    _in_layout("tp2pp2dp2", [*zero, "training.train_iters=2", "training.exit_interval=1", f"checkpoint.dir={orig}"])
    saved = latest_checkpoint(orig)
    assert saved is not None and read_metadata(saved)["step"] == 1
    reference = _in_layout("tp2pp2dp2", [*zero, "training.train_iters=2", f"checkpoint.load={saved}",
                                         f"checkpoint.dir={tmp_path / 'ref'}"])  # fmt: skip
    assert len(reference) == 1
    for name in ("tp1pp1dp1", "tp1pp2dp4", "tp4", "pp2vpp2dp2-zero"):
        # loading and saving again without a step reproduces every weight and optimizer moment exactly
        again = tmp_path / f"again-{name}"
        _in_layout(name, ["training.train_iters=1", f"checkpoint.load={saved}", f"checkpoint.dir={again}"])
        resaved = latest_checkpoint(again)
        names = arrays(saved)
        assert any(str(a).startswith("optimizer/") for a in names) and arrays(resaved) == names
        for array in names:
            assert torch.equal(read_region(saved / array), read_region(resaved / array)), (name, array)
        # and the next step's loss matches the original layout's
        losses = _in_layout(name, ["training.train_iters=2", f"checkpoint.load={saved}",
                                   f"checkpoint.dir={tmp_path / ('next-' + name)}"])  # fmt: skip
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5), name


def test_sigterm_saves_and_exits_cleanly(tmp_path: Path) -> None:
    ckpt = tmp_path / "run"
    cmd = [sys.executable, "-m", "mcore_train.cli", "pretrain", "--recipe", "tiny", *TINY_MODEL,
           "training.train_iters=100000", f"checkpoint.dir={ckpt}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    metrics = ckpt / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    latest = latest_checkpoint(ckpt)
    assert latest is not None
    meta = read_metadata(latest)
    assert meta["reason"] == "SIGTERM" and 3 <= meta["step"] < 100000
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if "loss" in line]
    assert meta["step"] >= steps[-1]


def test_nan_loss_stops_naming_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_train import TrainingDiverged

    nan_at_step(monkeypatch, 3)
    with pytest.raises(TrainingDiverged, match="the loss is nan at step 3"):
        pretrain(config("training.train_iters=6"))


def test_nan_loss_skipped_when_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    nan_at_step(monkeypatch, 3)
    result = pretrain(config("training.train_iters=6", "training.on_nan=skip", f"checkpoint.dir={tmp_path}"))
    assert result.steps == 6 and len(result.losses) == 5
    assert read_metadata(latest_checkpoint(tmp_path))["skipped_steps"] == 1


def test_batch_size_rampup_and_time_limit(tmp_path: Path) -> None:
    ramp = pretrain(config("training.global_batch_size=12", "training.rampup_batch_size=[4,4,16]",
                           "training.train_iters=5", f"checkpoint.dir={tmp_path / 'ramp'}"))  # fmt: skip
    sizes = [json.loads(x)["global_batch_size"] for x in (tmp_path / "ramp" / "metrics.jsonl").read_text().splitlines()]
    assert ramp.steps == 5 and sizes == [4, 4, 8, 12, 12]
    timed = pretrain(config("training.train_iters=1000", "training.exit_duration_minutes=0.00001",
                            f"checkpoint.dir={tmp_path / 'timed'}"))  # fmt: skip
    assert timed.exit_reason == "time_limit" and timed.steps == 1
    assert read_metadata(latest_checkpoint(tmp_path / "timed"))["reason"] == "time_limit"


def test_async_checkpoints_reserve_their_staging_buffer_after_the_first_step(tmp_path: Path, monkeypatch) -> None:
    """With async saves the loop allocates the host staging buffer in the background after its first step, so no
    save allocates it while training waits."""
    from mcore_parallel.checkpoint.sharded import StagingBuffer

    calls: list[bool] = []
    allocate = StagingBuffer._allocate

    def spy(self: StagingBuffer, total: int, pin: bool, touch: bool) -> None:
        calls.append(touch)
        allocate(self, total, pin, touch)

    monkeypatch.setattr(StagingBuffer, "_allocate", spy)
    pretrain(config("training.train_iters=4", "checkpoint.save_interval=2", "checkpoint.async_save=true",
                    f"checkpoint.dir={tmp_path}"))  # fmt: skip
    assert calls == [True]  # one allocation, the background one; both saves staged into it
    assert (tmp_path / "step_0000004").is_dir() and (tmp_path / "step_0000002").is_dir()


@pytest.mark.parametrize("fused", [False, True], ids=["read-every-step", "deferred-read"])
def test_zeros_are_counted_only_on_logged_steps(tmp_path: Path, monkeypatch, fused: bool) -> None:
    """The loop asks the optimizer for the zero count on the steps it logs, and the log carries it (with the
    deferred read too, where the count comes back with the step's other values)."""
    import json

    import mcore_parallel.optim.optimizer as optimizer_module

    calls: list[int] = []
    count = optimizer_module.count_zeros_tensor

    def spy(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return count(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(optimizer_module, "count_zeros_tensor", spy)
    extra = ["optimizer.fused=true", "training.device=cpu"] if fused else []
    pretrain(config("training.train_iters=6", "logging.log_interval=3", f"logging.dir={tmp_path}", *extra))
    assert len(calls) == 4  # steps 1 and 2 (the first interval's), 3 and 6
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "num_zeros" in r]
    assert len(logged) == 4 and all(isinstance(r["num_zeros"], int) for r in logged)
