"""Typed recipes, choices checked by the loader, and the components' own configs inside the tree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import pytest

from mcore_models import preset
from mcore_parallel import ParallelConfig
from mcore_parallel.ddp import DDPConfig
from mcore_train import RECIPES, ConfigError, TrainConfig, load_config
from mcore_train._typed import convert
from mcore_train.config import config_changes
from tests.train._util import config

# The recipes' values as they were written when recipes were plain mappings: a typed recipe must keep every one.
_PRETRAINING = {
    "optimizer": {"weight_decay": 0.1, "adam_beta2": 0.95, "clip_grad": 1.0, "use_distributed_optimizer": True},
    "data": {"tokenizer": "hf"},
    "scheduler": {"decay_style": "cosine"},
    "checkpoint": {"async_save": True},
}
EXPECTED: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "model": {
            "num_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 384,
            "activation": "swiglu",
            "normalization": "rmsnorm",
            "position_embedding": "rope",
            "add_bias_linear": False,
            "vocab_size": 259,
            "make_vocab_size_divisible_by": 64,
            "max_position_embeddings": 256,
            "share_embeddings_and_output_weights": True,
        },
        "data": {"seq_length": 256, "tokenizer": "byte", "split": "98,2,0"},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "adam_beta2": 0.95, "clip_grad": 1.0},
        "scheduler": {"decay_style": "cosine", "warmup_iters": 20, "min_lr": 3e-4},
        "training": {
            "micro_batch_size": 8,
            "global_batch_size": 16,
            "train_iters": 300,
            "eval_interval": 100,
            "eval_iters": 4,
            "generate_at_end": 120,
        },
        "checkpoint": {"save_interval": 100, "keep_last": 2},
        "logging": {"log_interval": 10},
    },
}
# seq length, lr, warmup, micro-batch, global batch, iterations, eval interval, save interval
_RUNS = {
    "gpt2-124m": (1024, 6e-4, 700, 16, 512, 20000, 1000, 1000),
    "llama-1b": (4096, 3e-4, 2000, 4, 256, 100000, 2000, 1000),
    "llama3-8b": (8192, 3e-4, 2000, 1, 128, 100000, 2000, 500),
}
for _name, (_seq, _lr, _warmup, _micro, _global, _iters, _eval, _save) in _RUNS.items():
    EXPECTED[_name] = {
        "data": {**_PRETRAINING["data"], "seq_length": _seq},
        "optimizer": {**_PRETRAINING["optimizer"], "lr": _lr},
        "scheduler": {**_PRETRAINING["scheduler"], "warmup_iters": _warmup, "min_lr": _lr / 10},
        "training": dict(micro_batch_size=_micro, global_batch_size=_global, train_iters=_iters, eval_interval=_eval),
        "checkpoint": {**_PRETRAINING["checkpoint"], "save_interval": _save},
    }
EXPECTED["llama3-8b"]["parallel"] = {"tp": 2, "pp": 1, "sequence_parallel": True}
EXPECTED["moe-tiny"] = {k: v for k, v in EXPECTED["tiny"].items() if k != "model"}
_LAYOUT_RUNS = {
    "moe-8x4k": ((4096, 3e-4, 2000, 4, 256, 100000, 2000, 1000), {}),
    "moe-32x1k": ((4096, 3e-4, 2000, 4, 256, 100000, 2000, 1000), {}),
    "mixtral-8x7b": ((4096, 3e-4, 2000, 1, 256, 100000, 2000, 500), {"pp": 4, "ep": 8}),
    "qwen3-moe-30b-a3b": ((4096, 3e-4, 2000, 1, 256, 100000, 2000, 500), {"ep": 8}),
    "deepseek-v3": ((4096, 2.2e-4, 2000, 1, 2048, 100000, 2000, 500),
                    {"pp": 16, "ep": 64, "first_stage_layers": 3, "last_stage_layers": 2}),
    "mamba2-130m": ((2048, 3e-3, 1000, 16, 256, 100000, 2000, 1000), {}),
    "mamba2-1.3b": ((2048, 1e-3, 2000, 8, 256, 100000, 2000, 1000), {}),
    "hybrid-1b": ((4096, 3e-4, 2000, 4, 256, 100000, 2000, 1000), {}),
    "nemotron-h-8b": ((8192, 3e-4, 2000, 1, 128, 100000, 2000, 500), {"tp": 2, "sequence_parallel": True}),
}  # fmt: skip
for _name, ((_seq, _lr, _warmup, _micro, _global, _iters, _eval, _save), _parallel) in _LAYOUT_RUNS.items():
    EXPECTED[_name] = {
        "data": {**_PRETRAINING["data"], "seq_length": _seq},
        "optimizer": {**_PRETRAINING["optimizer"], "lr": _lr},
        "scheduler": {**_PRETRAINING["scheduler"], "warmup_iters": _warmup, "min_lr": _lr / 10},
        "training": dict(micro_batch_size=_micro, global_batch_size=_global, train_iters=_iters, eval_interval=_eval),
        "checkpoint": {**_PRETRAINING["checkpoint"], "save_interval": _save},
        "parallel": _parallel,
    }
EXPECTED["hybrid-tiny"] = {k: v for k, v in EXPECTED["tiny"].items() if k != "model"}
EXPECTED["llava-tiny"] = {
    "model": {"num_layers": 2, "hidden_size": 64, "vocab_size": 260, "position_embedding": "rope"},
    "data": {"seq_length": 96, "tokenizer": "byte", "multimodal": True},
    "training": {"micro_batch_size": 8, "global_batch_size": 16, "train_iters": 100, "eval_iters": 0},
    "multimodal": {"vision": "tiny-clip", "projector": "mlp", "freeze": [], "image_token_id": None},
}
EXPECTED["llava-1b-clip336"] = {
    "data": {"seq_length": 4096, "tokenizer": "hf", "multimodal": True},
    "optimizer": {"use_distributed_optimizer": True},
    "multimodal": {"vision": "clip-vit-l14-336", "vision_feature_layer": -2, "projector": "mlp"},
}


def test_the_recipes_are_the_ones_there_were() -> None:
    assert list(RECIPES) == list(EXPECTED)
    for name, sections in EXPECTED.items():
        cfg = load_config(recipe=name)
        tree = cfg.to_dict()
        if name in ("moe-tiny", "hybrid-tiny"):
            assert cfg.model == preset(name, vocab_size=259), name  # float32, the byte tokenizer's vocabulary
        elif name == "llava-1b-clip336":
            assert cfg.model == preset("llama-1b", params_dtype="bfloat16"), name
        elif name not in ("tiny", "llava-tiny"):
            assert cfg.model == preset(name, params_dtype="bfloat16"), name
        for section, keys in sections.items():
            for key, value in keys.items():
                assert tree[section][key] == value, (name, section, key)


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_is_a_typed_config_that_validates(name: str, tmp_path: Path) -> None:
    built = RECIPES[name]()
    assert isinstance(built, TrainConfig)
    loaded = load_config(recipe=name)
    assert loaded.recipe == name and loaded.to_dict() == {**built.to_dict(), "recipe": name}
    data = ["data.mock=true"]
    if built.data.multimodal:  # image-text shards, not mock tokens
        from mcore_data.multimodal_prep import write_synthetic

        write_synthetic(tmp_path / "mm", 2)
        data = [f"data.path={tmp_path / 'mm'}"]
    runnable = load_config(recipe=name, overrides=[*data, f"data.tokenizer_model={tmp_path / 't.json'}"])
    par = runnable.parallel  # fits its smallest world: the expert layout needs ep x expert_tp ranks per stage
    per_stage = par.tp * par.ep if par.expert_tp_size == par.tp else math.lcm(par.tp, par.ep * par.expert_tp_size)
    runnable.check_layout(par.pp * per_stage)


def test_a_recipes_changes_survive_a_preset_override() -> None:
    """A recipe enters the loader as what it changes from the defaults: a new preset keeps the recipe's dtype."""
    assert config_changes(RECIPES["llama-1b"]())["model"] == {"preset": "llama-1b", "params_dtype": "bfloat16"}
    cfg = load_config(recipe="llama-1b", overrides=["model.preset=gpt2-124m"])
    assert cfg.model == preset("gpt2-124m", params_dtype="bfloat16")
    assert cfg.optimizer.use_distributed_optimizer and cfg.data.seq_length == 4096


def test_bad_choices_are_all_reported_by_the_loader() -> None:
    with pytest.raises(ConfigError) as exc:
        config("data.tokenizer=gpt", "data.ordering=random", "scheduler.wsd_decay_style=exp", "training.compile=all",
               "training.compile_mode=fast", "parallel.dp_comm=ring", "training.on_nan=explode")  # fmt: skip
    assert sorted(exc.value.problems) == sorted([
        "data.tokenizer='gpt' must be one of byte, sentencepiece, hf",
        "data.ordering='random' must be one of fast, megatron",
        "scheduler.wsd_decay_style='exp' must be one of linear, cosine, sqrt",
        "training.compile='all' must be one of auto, none, layers",
        "training.compile_mode='fast' must be one of default, max-autotune-no-cudagraphs",
        "training.on_nan='explode' must be one of stop, skip",
        "parallel.dp_comm='ring' must be one of auto, nccl, p2p",
    ])  # fmt: skip
    # the good choices pass, and the other checks of a section still run with them
    assert config("training.compile=layers", "data.ordering=megatron").training.compile == "layers"
    with pytest.raises(ConfigError, match="training: set training.train_iters or training.train_tokens"):
        config("training.on_nan=skip", "training.train_iters=null")


def test_literal_conversion() -> None:
    errors: list[str] = []
    assert convert("b", Literal["a", "b"], "s.k", errors) == "b"
    assert convert(None, Literal["a", "b"] | None, "s.k", errors) is None
    assert convert(2, Literal[1, 2], "s.n", errors) == 2 and convert("2", Literal[1, 2], "s.n", errors) == 2
    assert errors == []
    convert("c", Literal["a", "b"] | None, "s.k", errors)
    convert(True, Literal[1, 2], "s.n", errors)  # a bool is not the integer 1
    assert errors == ["s.k='c' must be one of a, b", "s.n=True must be one of 1, 2"]
    switch = Literal["auto", True, False]  # a choice of booleans and a word, spelt as YAML spells them
    assert convert("true", switch, "s.b", []) is True and convert(False, switch, "s.b", []) is False
    assert convert("auto", switch, "s.b", []) == "auto"
    errors = []
    convert("maybe", switch, "s.b", errors)
    assert errors == ["s.b='maybe' must be one of auto, true, false"]


def test_the_parallel_section_is_the_parallel_config_and_holds_the_ddp_config() -> None:
    cfg = config("parallel.tp=2", "parallel.bucket_size=1000", "parallel.overlap_grad_reduce=false",
                 "parallel.gradient_accumulation_fusion=true")  # fmt: skip
    assert isinstance(cfg.parallel, ParallelConfig) and cfg.parallel.tp == 2
    assert cfg.parallel.ddp == DDPConfig(bucket_size=1000, overlap_grad_reduce=False)
    assert cfg.parallel.gradient_accumulation_fusion is True  # the trainer puts it (auto resolved) into the DDP config
    flat = cfg.to_dict()["parallel"]
    assert flat["bucket_size"] == 1000 and flat["gradient_accumulation_fusion"] is True and "ddp" not in flat
    assert "exchange" not in flat and "use_distributed_optimizer" not in flat  # set by the trainer, not keys
    with pytest.raises(ConfigError) as exc:
        config("parallel.bucket_sise=1", "parallel.exchange=p2p")
    assert "parallel.bucket_sise: unknown key; did you mean 'bucket_size'?" in exc.value.problems
    assert any(p.startswith("parallel.exchange: unknown key") for p in exc.value.problems)
    with pytest.raises(ConfigError) as exc:  # the components' own checks, named by section, with the section's
        config("parallel.tp=0", "parallel.tp_comm_chunks=0", "data.seq_length=1")
    text = str(exc.value)
    assert "parallel: tp=0 must be a positive integer" in text and "tp_comm_chunks=0 must be at least 1" in text
    assert "data: seq_length=1 must be at least 2" in text
    with pytest.raises(ConfigError, match="parallel: bucket_size=0 must be a positive number of elements or None"):
        config("parallel.bucket_size=0")


def _ddp_of_a_run() -> tuple[Any, Any, bool]:
    from mcore_train.trainer import setup

    cfg = config("parallel.bucket_size=1000", "parallel.overlap_grad_reduce=false",
                 "optimizer.use_distributed_optimizer=true", "parallel.dp_comm=nccl")  # fmt: skip
    run = setup(cfg)
    return run.ddp[0].config, cfg.parallel.ddp, run.state.config is cfg.parallel


def test_setup_uses_the_sections_configs_as_they_are() -> None:
    used, section, same_layout = _ddp_of_a_run()
    assert same_layout  # the ParallelState is built from the section itself, not a copy
    assert used == DDPConfig(bucket_size=1000, overlap_grad_reduce=False, use_distributed_optimizer=True)
    assert section.use_distributed_optimizer is False  # the section's DDPConfig is left as loaded
