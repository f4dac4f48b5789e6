"""Named recipes: functions returning a config tree (plain mappings), the starting point of ``load_config``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["RECIPES", "recipe_tree"]

Tree = dict[str, Any]


def tiny() -> Tree:
    """A small Llama-style model on byte tokens that trains on a laptop CPU in minutes (the demo)."""
    return {
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
    }


def gpt2_124m() -> Tree:
    return {
        "model": {"preset": "gpt2-124m", "params_dtype": "bfloat16"},
        "data": {"seq_length": 1024, "tokenizer": "hf"},
        "optimizer": {
            "lr": 6e-4,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
            "use_distributed_optimizer": True,
        },
        "scheduler": {"decay_style": "cosine", "warmup_iters": 700, "min_lr": 6e-5},
        "training": {"micro_batch_size": 16, "global_batch_size": 512, "train_iters": 20000, "eval_interval": 1000},
        "checkpoint": {"save_interval": 1000, "async_save": True},
    }


def llama_1b() -> Tree:
    return {
        "model": {"preset": "llama-1b", "params_dtype": "bfloat16"},
        "data": {"seq_length": 4096, "tokenizer": "hf"},
        "optimizer": {
            "lr": 3e-4,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
            "use_distributed_optimizer": True,
        },
        "scheduler": {"decay_style": "cosine", "warmup_iters": 2000, "min_lr": 3e-5},
        "training": {"micro_batch_size": 4, "global_batch_size": 256, "train_iters": 100000, "eval_interval": 2000},
        "checkpoint": {"save_interval": 1000, "async_save": True},
    }


def llama3_8b() -> Tree:
    return {
        "model": {"preset": "llama3-8b", "params_dtype": "bfloat16"},
        "data": {"seq_length": 8192, "tokenizer": "hf"},
        "optimizer": {
            "lr": 3e-4,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
            "use_distributed_optimizer": True,
        },
        "scheduler": {"decay_style": "cosine", "warmup_iters": 2000, "min_lr": 3e-5},
        "training": {"micro_batch_size": 1, "global_batch_size": 128, "train_iters": 100000, "eval_interval": 2000},
        "checkpoint": {"save_interval": 500, "async_save": True},
        "parallel": {"tp": 2, "pp": 1, "sequence_parallel": True},
    }


RECIPES: dict[str, Callable[[], Tree]] = {
    "tiny": tiny,
    "gpt2-124m": gpt2_124m,
    "llama-1b": llama_1b,
    "llama3-8b": llama3_8b,
}


def recipe_tree(name: str) -> Tree:
    from mcore_train.errors import ConfigError

    if name not in RECIPES:
        raise ConfigError([f"recipe: unknown recipe {name!r}; known: {', '.join(RECIPES)}"])
    return {"recipe": name, **copy.deepcopy(RECIPES[name]())}
