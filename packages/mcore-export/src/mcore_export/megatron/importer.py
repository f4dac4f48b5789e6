"""``import_megatron``: a Megatron-LM checkpoint (``torch_dist`` or legacy, any tp/pp/ep) -> an mcore checkpoint.

The model config comes from the checkpoint's saved ``args`` (Megatron flags given on the command line fill in or
must agree, :mod:`mcore_export.megatron.args`); tensors are read one at a time (:mod:`~mcore_export.megatron.reader`,
:mod:`~mcore_export.megatron.legacy`), renamed (:mod:`~mcore_export.megatron.layout`), checked against the model the
config describes and written as global arrays chunked for ``tp`` (:mod:`mcore_export._mcore_writer`), the same writer
the Hugging Face import uses. Every mismatch is collected and reported at once; a failed import leaves nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mcore_export._mcore_writer import check_layout, import_attrs, layout_infos, start_checkpoint, write_parameter
from mcore_export._source import resolve_dtype
from mcore_export._staging import check_output, staged_output
from mcore_export.megatron._unpickle import MegatronFormatError
from mcore_export.megatron.args import config_from_args, merge_flags, parse_megatron_flags
from mcore_export.megatron.layout import is_vocab
from mcore_export.megatron.reader import open_checkpoint
from mcore_models import TransformerConfig
from mcore_parallel.checkpoint.zarr_io import write_group_metadata
from mcore_parallel.sharding import ShardedTensor

__all__ = ["import_megatron", "megatron_config"]

logger = logging.getLogger(__name__)


def megatron_config(
    checkpoint: str | Path,
    iteration: int | None = None,
    flags: Sequence[str] | str = (),
    vocab_size: int | None = None,
) -> tuple[Any, TransformerConfig]:
    """The opened checkpoint and the ``TransformerConfig`` its args (and ``flags``) describe."""
    ckpt = open_checkpoint(checkpoint, iteration)
    ckpt.args = merge_flags(ckpt.args, parse_megatron_flags(flags), str(ckpt.path))  # what the reader goes by, too
    return ckpt, config_from_args(ckpt.args, str(ckpt.path), vocab_size)


def import_megatron(
    checkpoint: str | Path,
    out: str | os.PathLike[str],
    *,
    iteration: int | None = None,
    optimizer: bool = False,
    flags: Sequence[str] | str = (),
    vocab_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a Megatron-LM checkpoint into an mcore checkpoint at ``out``; returns its path.

    ``checkpoint``: a Megatron ``--save`` directory (its latest iteration, or ``iteration``) or one ``iter_NNNNNNN``
    directory. ``optimizer``: also import Adam's state (``torch_dist`` checkpoints saved with a model-space optimizer
    state), so training resumes at the saved iteration. ``flags``: Megatron flags (``--num-layers 2 ...``) for a
    checkpoint without saved args. ``vocab_size``: drop Megatron's padding rows beyond it (default: keep the padded
    vocabulary, which is what the Megatron model computes logits over). ``tp``/``pp``: the layout the output is
    chunked for and checked against (any layout loads it). ``dtype``: params dtype (default: the run's)."""
    ckpt, config = megatron_config(checkpoint, iteration, flags, vocab_size)
    if dtype is not None:
        config = config.replace(params_dtype={v: k for k, v in _DTYPES.items()}[resolve_dtype(dtype, config.dtype)])
    if optimizer and ckpt.format != "torch_dist":
        raise MegatronFormatError(f"{ckpt.path}: --optimizer reads torch_dist checkpoints only (legacy optimizer states "
                                  "are per-rank flat buffers); import the weights only, or re-save as torch_dist")  # fmt: skip
    check_layout(config, tp, pp)
    out_path = Path(out)
    check_output(out_path.absolute(), overwrite)
    infos = layout_infos(config, tp)
    source = {"format": f"megatron-{ckpt.format}", "path": str(Path(ckpt.path).absolute()), "iteration": ckpt.iteration}
    step = ckpt.iteration if optimizer else 0
    logger.info("importing %s (%s, iteration %d, %d tensors) into %s", ckpt.path, ckpt.format, ckpt.iteration,
                len(infos), out_path)  # fmt: skip
    with staged_output(out_path, overwrite) as tmp:
        start_checkpoint(tmp, import_attrs(out_path, config, tp, pp, source, step=step))
        _write_all(tmp, ckpt, config, infos, optimizer)
    logger.info("imported %s into %s", ckpt.path, out_path)
    return out_path


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fit(key: str, t: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Megatron's tensor as mcore's: vocabulary rows cut to ``vocab_size``."""
    return t[: config.vocab_size] if is_vocab(key) else t


def _write_all(
    tmp: Path, ckpt: Any, config: TransformerConfig, infos: dict[str, ShardedTensor], optimizer: bool
) -> None:
    problems: list[str] = []
    seen: set[str] = set()
    tied = config.share_embeddings_and_output_weights
    masters_from_weights = optimizer and not ckpt.has_master_weights()
    if masters_from_weights and config.dtype != torch.float32:
        raise MegatronFormatError(f"{ckpt.path}: --optimizer: no fp32 master weights (optimizer.state.fp32_param.*) "
                                  f"for the {config.params_dtype} parameters")  # fmt: skip
    for n, (key, t) in enumerate(ckpt.model_tensors(config.num_layers)):
        if tied and key == "output_layer.weight":
            continue  # the last stage's copy of the embedding (pipeline-parallel runs)
        t = _fit(key, t, config)
        if _check(key, t, infos, problems, seen):
            write_parameter(tmp / "model" / key, infos[key], t.to(config.dtype))
            if masters_from_weights:  # fp32 training keeps no separate master copy: the weights are the master
                write_parameter(tmp / "optimizer" / key / "master", infos[key], t.float(), kind="master")
        if n % 16 == 15:
            logger.info("imported %d/%d tensors", len(seen), len(infos))
    missing = sorted(set(infos) - seen)
    if missing:
        problems.append(f"missing tensors {missing}")
    if problems:
        raise MegatronFormatError(
            f"{ckpt.path}: the checkpoint does not match the model its args describe ({_describe(config)}): "
            + "; ".join(problems)
            + ". If the args are wrong or absent, pass the run's Megatron flags after -- (--num-layers, "
            "--hidden-size, --num-attention-heads, --num-query-groups, --ffn-hidden-size, --swiglu, ...)"
        )
    if optimizer:
        _write_optimizer(tmp, ckpt, config, infos)


def _check(key: str, t: torch.Tensor, infos: dict[str, ShardedTensor], problems: list[str], seen: set[str]) -> bool:
    info = infos.get(key)
    if info is None:
        problems.append(f"unexpected tensor {key} {tuple(t.shape)}")
        return False
    if tuple(t.shape) != tuple(info.global_shape):
        problems.append(f"{key}: shape {tuple(t.shape)}, the model's is {tuple(info.global_shape)}")
        return False
    seen.add(key)
    return True


def _describe(c: TransformerConfig) -> str:
    return (f"num_layers={c.num_layers}, hidden_size={c.hidden_size}, num_attention_heads={c.num_attention_heads}, "
            f"num_query_groups={c.query_groups}, ffn_hidden_size={c.ffn_size}, activation={c.activation}, "
            f"vocab_size={c.vocab_size}")  # fmt: skip


def _write_optimizer(tmp: Path, ckpt: Any, config: TransformerConfig, infos: dict[str, ShardedTensor]) -> None:
    """``optimizer/<key>/{exp_avg,exp_avg_sq}`` (and ``master``, where the run kept an fp32 copy of lower-precision
    weights) from the saved Adam state."""
    tied = config.share_embeddings_and_output_weights
    written: dict[str, set[str]] = {}
    for key, state, t in ckpt.optimizer_tensors(config.num_layers):
        if key not in infos or (tied and key == "output_layer.weight"):
            continue
        write_parameter(tmp / "optimizer" / key / state, infos[key], _fit(key, t, config).float(), kind=state)
        written.setdefault(key, set()).add(state)
    for key in infos:
        states = written.get(key, set())
        if not {"exp_avg", "exp_avg_sq"} <= states:
            raise MegatronFormatError(f"{ckpt.path}: no Adam state (exp_avg, exp_avg_sq) for {key}")
        write_group_metadata(tmp / "optimizer" / key)
