"""Configuration: recipes, YAML + dotted overrides, and every error reported at once."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from mcore_train import RECIPES, ConfigError, load_config
from mcore_train.config import SchedulerSection
from mcore_train.scheduler import LRScheduler
from tests.train._util import config


def test_recipes_load_and_round_trip_through_yaml(tmp_path: Path) -> None:
    for name in RECIPES:
        cfg = load_config(recipe=name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(cfg.to_yaml())
        again = load_config(path=path)
        assert again.to_dict() == cfg.to_dict(), name


def test_overrides_and_types() -> None:
    cfg = config("optimizer.lr=3e-4", "parallel.tp=2", "training.train_iters=7", "data.path=[a, b]",
                 "checkpoint.async_save=true", "model.rope_scaling={factor: 8.0}")  # fmt: skip
    assert cfg.optimizer.lr == 3e-4 and cfg.parallel.tp == 2 and cfg.training.train_iters == 7
    assert cfg.data.path == ["a", "b"] and cfg.checkpoint.async_save is True
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 8.0
    assert load_config(recipe="llama-1b").model.num_layers == 16


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("optimzer:\n  lr: 1\ntraining:\n  micro_batch_size: two\n  on_nan: explode\n")
    with pytest.raises(ConfigError) as exc:
        load_config(recipe="tiny", path=yaml_file, overrides=["model.hidden_sise=3", "data.ordering=random",
                                                               "scheduler.decay_style=exp"])  # fmt: skip
    text = str(exc.value)
    for expected in (
        "optimzer: unknown section; did you mean 'optimizer'?",
        "training.micro_batch_size: expected an integer, got 'two'",
        "model.hidden_sise: unknown key; did you mean 'hidden_size'?",
        "data.ordering='random' must be one of fast, megatron",
        "scheduler.decay_style='exp' must be one of cosine, linear, constant, wsd",
        "training.on_nan='explode' must be one of stop, skip",
    ):
        assert expected in text, expected
    assert len(exc.value.problems) == 6


def test_layout_problems_for_a_world_size() -> None:
    cfg = config("training.global_batch_size=10", "parallel.pp=3", "parallel.tp=3")
    with pytest.raises(ConfigError) as exc:
        cfg.check_layout(18)
    text = str(exc.value)
    assert (
        "global_batch_size=10 is not divisible by micro_batch_size x dp = 2 x 2 = 4; set it to a multiple of 4" in text
    )
    assert "num_attention_heads=4 is not divisible by the tensor-parallel size 3" in text
    assert "parallel:" in text  # 4 layers do not split over 3 stages
    with pytest.raises(ConfigError, match="world size 4 is not divisible by tp"):
        config("parallel.tp=3").check_layout(4)
    with pytest.raises(ConfigError, match="no training data"):
        config("data.mock=false").check_layout(1)
    with pytest.raises(ConfigError, match="data.tokenizer='hf' needs data.tokenizer_model"):
        load_config(recipe="llama-1b", overrides=["data.mock=true"]).check_layout(1)


def test_a_layout_that_does_not_fit_is_one_problem_among_the_others() -> None:
    """tp=3 on one process: one ConfigError lists the layout (in integers) with a misspelt key and the heads."""
    with pytest.raises(ConfigError) as exc:
        config("parallel.tp=3", "optimizer.lrr=1", world_size=1)
    problems = exc.value.problems
    assert "optimizer.lrr: unknown key; did you mean 'lr'?" in problems
    assert any(p.startswith("parallel: world size 1 is not divisible by tp*cp*pp = 3*1*1 = 3; launch a multiple")
               for p in problems), problems  # fmt: skip
    with pytest.raises(ConfigError) as exc:
        config("parallel.tp=3", world_size=1)
    text = str(exc.value)
    assert "world size 1 is not divisible by tp*cp*pp = 3*1*1 = 3" in text
    assert "num_attention_heads=4 is not divisible by the tensor-parallel size 3" in text
    assert "0.33" not in text and "dp*cp" not in text and "for 1 rank(s)" in text
    assert config("parallel.tp=2", world_size=2).parallel.tp == 2  # a layout that fits loads


def test_a_missing_data_prefix_is_a_listed_problem(tmp_path: Path) -> None:
    (tmp_path / "full.idx").write_bytes(b"")
    (tmp_path / "full.bin").write_bytes(b"")
    (tmp_path / "half.idx").write_bytes(b"")
    blend = f"data.path=[0.2, {tmp_path / 'full'}, 0.3, {tmp_path / 'half'}, 0.5, {tmp_path / 'none'}]"
    with pytest.raises(ConfigError) as exc:
        config("data.mock=false", blend, "optimizer.lrr=1", world_size=1)
    problems = exc.value.problems
    assert len(problems) == 3 and "optimizer.lrr: unknown key; did you mean 'lr'?" in problems, problems
    half, none = (p for p in problems if p.startswith("data.path"))
    half_prefix = tmp_path / "half"
    assert f"no dataset at prefix '{half_prefix}': {half_prefix}.idx exists but {half_prefix}.bin is missing" in half
    assert f"neither {tmp_path / 'none'}.idx nor {tmp_path / 'none'}.bin exists" in none
    with pytest.raises(ConfigError, match=r"data.train_path: no dataset at prefix '.*none'"):
        config("data.mock=false", f"data.train_path={tmp_path / 'none'}").check_layout(1)
    config("data.mock=false", f"data.path={tmp_path / 'full'}").check_layout(1)


def test_bad_override_syntax_and_missing_file() -> None:
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        config("optimizer.lr")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path="/nonexistent/x.yaml")
    with pytest.raises(ConfigError, match="unknown recipe 'huge'"):
        load_config(recipe="huge")


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "wsd"])
def test_lr_schedules(style: str) -> None:
    sched = LRScheduler(SchedulerSection(decay_style=style, warmup_iters=10, min_lr=0.1, wsd_decay_iters=20), 1.0, 110)
    lrs = [sched.lr(s) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup to the peak
    if style == "constant":
        assert all(lr == 1.0 for lr in lrs[10:])
        return
    assert lrs[109] > 0.1 - 1e-9 and lrs[115] == pytest.approx(0.1)  # min_lr after decay
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(lrs[10:]))  # never increases after warmup
    if style == "wsd":
        assert all(lr == 1.0 for lr in lrs[10:90]) and lrs[100] == pytest.approx(0.55)
    if style == "cosine":
        assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # half way: the mean of peak and min
    if style == "linear":
        assert lrs[60] == pytest.approx(0.55)


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml")), ids=lambda p: p.name
)
def test_example_yaml_files_load(path: Path) -> None:
    cfg = load_config(path=path)
    assert cfg.recipe is not None and cfg.model.num_layers > 0


def test_tp_comm_choices_are_checked() -> None:
    with pytest.raises(ConfigError, match="parallel.tp_comm='ring' must be one of auto, nccl, symmetric_memory, p2p"):
        config("parallel.tp_comm=ring")
    with pytest.raises(ConfigError, match="tp_comm=symmetric_memory applies to sequence-parallel layers"):
        config("parallel.tp_comm=symmetric_memory", "parallel.tp=2")
    with pytest.raises(ConfigError, match="parallel.dp_comm='ring' must be one of auto, nccl, p2p"):
        config("parallel.dp_comm=ring")
    with pytest.raises(ConfigError, match="tp_comm_chunks=0 must be at least 1"):
        config("parallel.tp_comm_chunks=0")
    with pytest.raises(ConfigError, match="tp_comm=p2p applies to sequence-parallel layers"):
        config("parallel.tp_comm=p2p", "parallel.tp=2")


def _setup_error() -> str:
    from mcore_train.trainer import setup

    try:
        setup(config("parallel.tp_comm=symmetric_memory", "parallel.tp=2", "parallel.sequence_parallel=true",
                     "training.device=cpu"))  # fmt: skip
    except ConfigError as e:
        return str(e)
    return "no error"


def test_symmetric_memory_refuses_a_cpu_run() -> None:
    from mcore_parallel.testing import run_distributed

    for message in run_distributed(_setup_error, 2):
        assert "symmetric_memory needs CUDA GPUs (this run is on cpu)" in message, message
