"""Small configs for the training tests."""

from __future__ import annotations

from typing import Any

from mcore_train import TrainConfig, load_config

TINY_MODEL = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=64",
    "model.max_position_embeddings=64",
    "data.seq_length=16",
    "data.mock=true",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.eval_iters=0",
    "training.generate_at_end=0",
    "logging.progress_bar=false",
    "logging.log_interval=1",
    "optimizer.lr=0.01",
    "scheduler.warmup_iters=2",
]


def config(*overrides: str, **kw: Any) -> TrainConfig:
    return load_config(recipe="tiny", overrides=[*TINY_MODEL, *overrides], **kw)
