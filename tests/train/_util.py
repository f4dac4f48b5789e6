"""Small configs for the training tests."""

from __future__ import annotations

from typing import Any

import pytest

from mcore_train import TrainConfig, load_config, step

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

CPU_RUN = [
    "data.mock=true",
    "data.seq_length=32",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.train_iters=3",
    "training.eval_iters=0",
    "training.generate_at_end=0",
    "training.device=cpu",
    "logging.progress_bar=false",
    "logging.log_interval=1",
    "scheduler.warmup_iters=0",
    "optimizer.lr=0.01",
]
"""Three logged steps of a recipe's own model on mock data, on the CPU (the MoE and hybrid layout tests)."""


def config(*overrides: str, **kw: Any) -> TrainConfig:
    return load_config(recipe="tiny", overrides=[*TINY_MODEL, *overrides], **kw)


_SCHEDULE = step._schedule_loss  # the real one: every injection wraps it, not an earlier injection


def nan_at_step(monkeypatch: pytest.MonkeyPatch, bad_step: int) -> None:
    """The training loss of the ``bad_step``-th step (1-based) becomes nan (evaluation is untouched)."""
    calls = {"train": 0}

    def patched(run, iterators, num_micro, forward_only):  # type: ignore[no-untyped-def]
        loss = _SCHEDULE(run, iterators, num_micro, forward_only)
        if not forward_only:
            calls["train"] += 1
            if calls["train"] == bad_step:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(step, "_schedule_loss", patched)
