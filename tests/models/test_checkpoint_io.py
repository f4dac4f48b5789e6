"""Weights-only model checkpoints: save under one TP/PP layout, rebuild the config and load under another."""

from __future__ import annotations

from pathlib import Path

import torch

from mcore_models import GPTModel
from mcore_models.checkpoint import (
    load_weights,
    model_config_from_checkpoint,
    resolve_checkpoint,
    save_weights,
    tokenizer_spec_from_checkpoint,
)
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests._model_configs import llama

CONFIG = llama(num_query_groups=4, share_embeddings_and_output_weights=True, num_layers=4)


def _save(root: str) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=2, pp=2))
    layers = range(0, 2) if state.is_first_stage else range(2, 4)
    model = GPTModel(CONFIG, tp=state.tp, pre_process=state.is_first_stage, post_process=state.is_last_stage,
                     layers=layers)  # fmt: skip
    save_weights(model, state, root, metadata={"tokenizer": {"kind": "hf", "path": "tokenizer/tokenizer.json"}})


def test_save_tp2_pp2_load_single_process(tmp_path: Path) -> None:
    run_distributed(_save, 4, str(tmp_path))
    ckpt = resolve_checkpoint(tmp_path)
    assert model_config_from_checkpoint(tmp_path) == CONFIG
    assert tokenizer_spec_from_checkpoint(tmp_path) == {"kind": "hf", "path": str(ckpt / "tokenizer/tokenizer.json")}
    loaded = GPTModel(CONFIG.replace(seed=777), tp=Group.single())
    load_weights(loaded, tmp_path)
    reference = GPTModel(CONFIG)  # the seed-derived init equals what the TP2xPP2 run saved
    for (name, a), b in zip(loaded.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
