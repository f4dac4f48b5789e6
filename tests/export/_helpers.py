"""Tiny configs and checkpoint builders shared by the export tests.

Weights are not the seed-derived initialisation (norms of ones, zero biases): every parameter is overwritten with a
random global tensor drawn from a seed derived from its name, so the same values come out under any layout and no
tensor is trivial.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_models import GPTModel, TransformerConfig
from mcore_models.checkpoint import load_weights, model_config_from_checkpoint, save_weights
from mcore_parallel import ParallelConfig, ParallelState
from tests._model_configs import gpt2 as base_gpt2
from tests._model_configs import llama as base_llama


def llama(**kw: Any) -> TransformerConfig:
    """The shared tiny Llama with a vocabulary of 101 (never a multiple of tp: exercises vocabulary padding)."""
    return base_llama(**{"vocab_size": 101, **kw})


def gpt2(**kw: Any) -> TransformerConfig:
    return base_gpt2(**{"vocab_size": 101, **kw})


def global_value(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    t = torch.randn(shape, generator=g) * (0.2 if len(shape) == 1 else 0.08)
    if len(shape) == 1 and "norm" in key and key.endswith("weight"):
        t += 1.0
    return t


def randomize(model: GPTModel) -> GPTModel:
    for info in model.sharded_state_dict().values():
        info.load_from(global_value(info.key, info.global_shape).to(info.local.dtype))
    return model


def reference_model(config: TransformerConfig) -> GPTModel:
    """The single-process model holding the same weights as any checkpoint :func:`save` writes."""
    return randomize(GPTModel(config)).eval()


def _save_rank(config: TransformerConfig, tp: int, pp: int, root: str, metadata: dict[str, Any]) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp))
    n = config.num_layers // pp
    stage = state.pp.rank
    model = GPTModel(
        config,
        tp=state.tp,
        pre_process=state.is_first_stage,
        post_process=state.is_last_stage,
        layers=range(stage * n, (stage + 1) * n),
    )
    save_weights(randomize(model), state, root, metadata=metadata)


def save(config: TransformerConfig, root: Path, tp: int = 1, pp: int = 1, tokenizer: dict | None = None) -> Path:
    """Write a checkpoint of the randomised model under a tp x pp layout (gloo ranks); returns its directory."""
    from mcore_parallel.testing import run_distributed

    meta = {"tokenizer": tokenizer} if tokenizer else {}
    run_distributed(_save_rank, tp * pp, config, tp, pp, str(root), meta)
    return root / "step_0000000"


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, gather_logits=True)


def cached_checkpoint(cache: dict, root: Path, name: str, config: TransformerConfig, tp: int, pp: int) -> Path:
    """A checkpoint of ``config`` saved under tp x pp, written once per test session."""
    if (name, tp, pp) not in cache:
        cache[(name, tp, pp)] = save(config, root / f"{name}-tp{tp}pp{pp}", tp, pp)
    return cache[(name, tp, pp)]


def load_and_run(ckpt: str, tp: int, pp: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits (gathered) of a checkpoint loaded at tp x pp (one gloo rank each; None on non-last stages)."""
    state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp))
    config = model_config_from_checkpoint(ckpt)
    n = config.num_layers // pp
    s = state.pp.rank
    model = GPTModel(config.replace(seed=99), tp=state.tp, pre_process=state.is_first_stage,
                     post_process=state.is_last_stage, layers=range(s * n, (s + 1) * n)).eval()  # fmt: skip
    load_weights(model, ckpt)
    with torch.no_grad():
        if pp == 1:
            return model(ids, gather_logits=True)
        hidden = model(ids) if state.is_first_stage else torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
        dist.broadcast(hidden, src=state.pp.ranks[0], group=state.pp.pg)
        if state.is_first_stage:
            return None
        model.set_input_tensor(hidden)
        return model(ids, gather_logits=True)
