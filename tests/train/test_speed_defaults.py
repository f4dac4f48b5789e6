"""``training.compile`` and ``parallel.gradient_accumulation_fusion`` default to ``auto``: the measured-faster path on
CUDA, the plain one on CPU, each explicit value kept, and one log line at start saying what was chosen and why."""

from __future__ import annotations

import logging

import pytest

from mcore_train import ConfigError
from mcore_train.speed import describe, resolve_speed
from mcore_train.trainer import setup

from ._util import config


def test_the_defaults_are_auto() -> None:
    cfg = config()
    assert cfg.training.compile == "auto" and cfg.parallel.gradient_accumulation_fusion == "auto"
    for recipe in ("tiny", "llama-1b", "moe-8x4k"):
        from mcore_train import load_config

        c = load_config(recipe=recipe)
        assert (c.training.compile, c.parallel.gradient_accumulation_fusion) == ("auto", "auto"), recipe


@pytest.mark.parametrize(
    ("overrides", "device", "want"),
    [
        ([], "cpu", ("none", False)),
        ([], "cuda", ("layers", True)),
        ([], "cuda:1", ("layers", True)),
        (["training.compile=layers", "parallel.gradient_accumulation_fusion=true"], "cpu", ("layers", True)),
        (["training.compile=none", "parallel.gradient_accumulation_fusion=false"], "cuda", ("none", False)),
        (["model.preset=moe-tiny"], "cuda", ("none", True)),  # trains on aux losses: compiled layers drop them
        (["model.preset=moe-tiny", "model.moe.aux_loss_coeff=0"], "cuda", ("layers", True)),
        (["parallel.tp_comm_in_graph=true"], "cuda", ("layers", False)),
    ],
    ids=["cpu", "cuda", "cuda1", "forced-on-cpu", "off-on-cuda", "moe-aux", "moe-no-aux", "tp-comm-in-graph"],
)
def test_auto_resolves_by_device(overrides: list[str], device: str, want: tuple[str, bool]) -> None:
    choices = resolve_speed(config(*overrides), device)
    assert (choices.compile, choices.gradient_accumulation_fusion) == want


def test_the_line_says_what_why_and_how_to_turn_off() -> None:
    line = describe(resolve_speed(config(), "cuda"))
    assert "training.compile=layers (auto on cuda" in line
    assert "parallel.gradient_accumulation_fusion=true (auto on cuda" in line
    assert line.endswith("turn off with training.compile=none parallel.gradient_accumulation_fusion=false")
    off = describe(resolve_speed(config("training.compile=none", "parallel.gradient_accumulation_fusion=false"),
                                 "cuda"))  # fmt: skip
    assert "training.compile=none (as set)" in off and "turn off" not in off
    cpu = describe(resolve_speed(config(), "cpu"))
    assert "training.compile=none (auto on cpu" in cpu and "gradient_accumulation_fusion=false (auto on cpu" in cpu


def test_setup_logs_the_choice_once_and_applies_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_train.trainer"):
        run = setup(config("training.train_iters=3", "training.device=cpu"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speed switches:")]
    assert len(lines) == 1 and "training.compile=none (auto on cpu" in lines[0]
    assert run.speed is not None and run.speed.compile == "none"
    assert not run.ddp[0].config.gradient_accumulation_fusion
    assert all(layer._compiled_call_impl is None for layer in run.chunks[0].decoder.layers.values())
    forced = setup(config("training.train_iters=3", "training.device=cpu", "parallel.gradient_accumulation_fusion=on"))
    assert forced.ddp[0].config.gradient_accumulation_fusion


def test_a_bad_value_names_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        config("parallel.gradient_accumulation_fusion=sometimes", "training.compile=fast")
    assert sorted(exc.value.problems) == [
        "parallel.gradient_accumulation_fusion='sometimes' must be one of auto, true, false",
        "training.compile='fast' must be one of auto, none, layers",
    ]
    with pytest.raises(ConfigError, match="tp_comm_in_graph=true with gradient_accumulation_fusion=true"):
        config("parallel.tp_comm_in_graph=true", "parallel.gradient_accumulation_fusion=true")
    config("parallel.tp_comm_in_graph=true")  # auto: the fusion stays off, no error
