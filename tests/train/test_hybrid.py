"""Hybrid (Mamba-2 + attention + MLP) models through the real training loop (CPU, gloo, float32): every parallel
layout trains ``hybrid-tiny`` like one process on the same global batches, pipeline stages follow the pattern's ``|``
boundaries, a checkpoint saved at tp2 x pp2 resumes in one process, and the ``model.mamba`` keys are checked with the
field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcore_parallel.checkpoint import latest_checkpoint, read_metadata
from mcore_parallel.testing import run_distributed
from mcore_train import ConfigError, load_config, pretrain
from tests.train._util import CPU_RUN

RUN = CPU_RUN
STAGES = "model.hybrid_pattern=M*|-M-"  # two pipeline stages of 2 and 3 layers


def hybrid_config(*overrides: str, world_size: int | None = None) -> Any:
    return load_config(recipe="hybrid-tiny", overrides=[*RUN, *overrides], world_size=world_size)


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(hybrid_config(*overrides)).losses


def _in(world: int, overrides: list[str]) -> list[float]:
    if world == 1:
        return _losses(overrides)
    losses: list[float] = run_distributed(_losses, world, overrides, timeout=300)[0]
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses([f"checkpoint.dir={tmp_path_factory.mktemp('hybrid-ref')}"])


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", STAGES]),
    "dp2-distopt": (2, ["optimizer.use_distributed_optimizer=true"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2", STAGES]),
    "recompute": (1, ["model.recompute=full"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_layouts_train_like_one_process(name: str, reference: list[float], tmp_path: Path) -> None:
    world, overrides = LAYOUTS[name]
    got = _in(world, [*overrides, f"checkpoint.dir={tmp_path}"])
    assert len(reference) == 3 and reference[0] != reference[-1]  # the steps trained
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), name


def test_a_checkpoint_saved_at_tp2_pp2_resumes_in_one_process(tmp_path: Path) -> None:
    run = ["training.train_iters=5", "scheduler.decay_iters=5"]
    straight = _losses([*run, f"checkpoint.dir={tmp_path / 'straight'}"])
    first = _in(4, [*run, "parallel.tp=2", "parallel.pp=2", STAGES, "training.exit_interval=3",
                    f"checkpoint.dir={tmp_path / 'a'}"])  # fmt: skip
    saved = latest_checkpoint(tmp_path / "a")
    assert saved is not None and read_metadata(saved)["step"] == 3 and len(first) == 3
    rest = _losses([*run, f"checkpoint.load={saved}", f"checkpoint.dir={tmp_path / 'one'}"])
    assert first + rest == pytest.approx(straight, rel=1e-5, abs=1e-6)


def test_mamba_keys_from_overrides_keep_the_presets_other_settings() -> None:
    mamba = hybrid_config("model.mamba.d_state=8").model.mamba
    assert mamba is not None and (mamba.d_state, mamba.head_dim, mamba.n_groups) == (8, 16, 2)
    cases = {
        ("model.mamba.d_stat=8",): "model.mamba.d_stat: unknown key; did you mean 'd_state'?",
        ("model.mamba.n_groups=3",): "n_groups",
        ("model.hybrid_pattern=M*-M",): "hybrid_pattern='M*-M' has 4 layers",
        ("model.hybrid_pattern=M*-Mx",): "unknown character(s) ['x']",
        ("parallel.pp=3", STAGES): "has 2 pipeline stages",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as exc:
            hybrid_config(*overrides, world_size=6)
        assert any(message in p for p in exc.value.problems), (overrides, exc.value.problems)
