"""``export_megatron``: an mcore checkpoint -> a Megatron-Core ``torch_dist`` checkpoint (so a run can move back).

The output is a Megatron-LM save directory: ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` with the
tensors in PyTorch distributed checkpointing's format (``.metadata`` and one ``__0_0.distcp``, written by
``torch.distributed.checkpoint``'s own ``FileSystemWriter``), ``common.pt`` (``args``, ``iteration``,
``checkpoint_version``) and ``metadata.json``, under the names and layouts megatron-core's GPT model asks
``dist_checkpointing.load`` for (:func:`~mcore_export.megatron.layout.to_megatron_name`): layers stacked along a
leading axis, experts along a second, the vocabulary padded the way Megatron pads it for ``tp``
(``make_vocab_size_divisible_by * tp``), and an empty ``_extra_state`` for every linear layer. ``torch_dist`` is
global, so ``tp`` and ``pp`` only set the vocabulary padding and the saved args; megatron reshards on load.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from mcore_export._mcore_writer import check_layout
from mcore_export._source import CheckpointReader, resolve_dtype
from mcore_export._staging import staged_output
from mcore_export.megatron.args import args_from_config
from mcore_export.megatron.layout import EXTRA_STATE_MODULES, is_vocab, stacked_name, to_megatron_name
from mcore_export.megatron.reader import TRACKER
from mcore_models import TransformerConfig
from mcore_models.checkpoint import resolve_checkpoint

__all__ = ["export_megatron", "megatron_padded_vocab"]

logger = logging.getLogger(__name__)


def megatron_padded_vocab(config: TransformerConfig, tp: int, divisible_by: int) -> int:
    """Megatron's padded vocabulary for ``tp``: the import's padded size when it still fits, else the next multiple
    of ``divisible_by * tp``."""
    saved = config.extra.get("megatron_padded_vocab_size")
    if isinstance(saved, int) and saved == config.vocab_size and saved % tp == 0:
        return saved
    multiple = divisible_by * tp
    return math.ceil(config.vocab_size / multiple) * multiple


def _stacked(reader: CheckpointReader, config: TransformerConfig, dtype: torch.dtype, padded: int) -> dict[str, Any]:
    """Megatron's state dict: per-layer tensors stacked under ``decoder.layers.<name>``, extra states as bytes."""
    layers: dict[str, dict[int, str]] = defaultdict(dict)
    state: dict[str, Any] = {}
    keys = [p.name for p in sorted((reader.path / "model").iterdir()) if (p / "zarr.json").exists()]
    for key in keys:
        found = stacked_name(key)
        if found is None:
            t = reader.get(key).to(dtype)
            if is_vocab(key):
                t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
            state[key] = t
            continue
        inner, i = found
        layers[to_megatron_name(inner)][i] = key
    for name, by_layer in layers.items():
        if sorted(by_layer) != list(range(config.num_layers)):
            raise ValueError(f"{reader.path}: {name} exists in layers {sorted(by_layer)} only; Megatron's torch_dist "
                             "stacks layers that are all alike (mixed MoE/dense layers are not exported)")  # fmt: skip
        state[f"decoder.layers.{name}"] = torch.stack([reader.get(by_layer[i]).to(dtype) for i in sorted(by_layer)])
        logger.info("stacked %s", name)
    for module in EXTRA_STATE_MODULES:
        if f"decoder.layers.{module}.weight" in state:
            for i in range(config.num_layers):
                state[f"decoder.layers.{module}._extra_state/shard_{i}_{config.num_layers}"] = [
                    None
                ]  # a ShardedObject: [its data]; Transformer Engine reads None as no FP8 state
    if config.moe is not None:
        e = config.moe.num_experts
        for fc in ("linear_fc1", "linear_fc2"):
            for i in range(config.num_layers):
                for j in range(e):
                    item = f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{j}_{config.num_layers}.{e}"
                    state[item] = [None]  # a ShardedObject: [its data]; Transformer Engine reads None as no FP8 state
    return state


def export_megatron(
    checkpoint: str | Path,
    out: str | os.PathLike[str],
    *,
    tp: int = 1,
    pp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Megatron-LM save directory holding the checkpoint as ``torch_dist``; returns its path.

    Megatron-Core's ``dist_checkpointing.load`` reads it into a GPT model of the same architecture under any layout;
    Megatron-LM resumes it with ``--load OUT`` (``--finetune`` or ``--no-load-optim``: no optimizer state is written).
    """
    path = resolve_checkpoint(checkpoint)
    reader = CheckpointReader(path)
    config = reader.config
    if config.hybrid_pattern is not None:
        raise ValueError(f"{path}: hybrid (Mamba) models are not exported to Megatron-Core's GPT layout")
    check_layout(config, tp, pp)
    target = resolve_dtype(dtype, config.dtype)
    padded = megatron_padded_vocab(config, tp, make_vocab_size_divisible_by)
    step = int(reader.metadata.get("step", 0))
    extra = {"iteration": step, "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
             "consumed_train_samples": int(reader.metadata.get("consumed_samples", 0))}  # fmt: skip
    args = args_from_config(config.replace(params_dtype=_NAMES[target]), tp, pp, padded, **extra)
    with staged_output(out, overwrite) as tmp:
        iter_dir = tmp / f"iter_{step:07d}"
        iter_dir.mkdir()
        state = _stacked(reader, config, target, padded)
        dcp_save(state, storage_writer=FileSystemWriter(str(iter_dir)), no_dist=True)
        torch.save(_common(args, step), iter_dir / "common.pt")
        (iter_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
        (tmp / TRACKER).write_text(str(step))
    logger.info("exported %s as Megatron torch_dist (iteration %d, padded vocab %d) to %s", path, step, padded, out)
    return Path(out)


_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _common(args: argparse.Namespace, step: int) -> dict[str, Any]:
    return {"args": args, "checkpoint_version": 3.0, "iteration": step, "num_floating_point_operations_so_far": 0}
