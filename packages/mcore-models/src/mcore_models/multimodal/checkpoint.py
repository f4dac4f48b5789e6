"""Weights-only LLaVA checkpoints in mcore's sharded format, as :mod:`mcore_models.checkpoint` does for GPT models.

The arrays are :meth:`LlavaModel.sharded_state_dict`'s (``model/vision.*``, ``model/projector.*``,
``model/language.*``), so a checkpoint saved at one TP / PP layout loads at any other, and the metadata's
``"model"`` entry is :meth:`LlavaConfig.to_dict`. A training checkpoint (mcore-train's) holds the same arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_models.checkpoint import resolve_checkpoint
from mcore_models.multimodal.config import LlavaConfig
from mcore_models.multimodal.llava import LlavaModel
from mcore_parallel import ParallelState
from mcore_parallel.checkpoint import CheckpointManager, load_model, read_metadata
from mcore_parallel.checkpoint.zarr_io import CheckpointFormatError

__all__ = ["llava_config_from_checkpoint", "load_llava_weights", "save_llava_weights"]


def llava_config_from_checkpoint(path: str | Path, keep_backend: bool = False) -> LlavaConfig:
    """The checkpoint's :class:`LlavaConfig`, its language model with the torch (bf16) layer backend unless
    ``keep_backend`` (as :func:`~mcore_models.checkpoint.model_config_from_checkpoint`)."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt).get("model")
    if not isinstance(meta, dict) or not {"vision", "language"} <= set(meta):
        raise CheckpointFormatError(f"{ckpt}/zarr.json has no LLaVA model entry (a 'model' with 'vision' and "
                                    "'language'): it is not a LlavaModel checkpoint")  # fmt: skip
    config = LlavaConfig.from_dict(meta)
    lm = config.language
    if keep_backend or lm.layer_backend == "torch":
        return config
    return config.replace(language=lm.replace(backend="auto" if lm.backend == "auto" else "torch", fp8=None))


def _chunks(models: LlavaModel | Sequence[LlavaModel]) -> list[LlavaModel]:
    return [models] if isinstance(models, LlavaModel) else list(models)


def load_llava_weights(models: LlavaModel | Sequence[LlavaModel], path: str | Path) -> Path:
    """Load the weights this rank holds (any saving layout) into one model or a list of pipeline chunks."""
    ckpt = resolve_checkpoint(path)
    for chunk in _chunks(models):
        load_model(ckpt, chunk.sharded_state_dict())
    return ckpt


def save_llava_weights(
    models: LlavaModel | Sequence[LlavaModel],
    state: ParallelState,
    root: str | Path,
    name: str = "step_0000000",
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a weights-only checkpoint (collective) with the LlavaConfig in its metadata; returns its path."""
    chunks = _chunks(models)
    items = {}
    for chunk in chunks:
        items.update(chunk.sharded_state_dict())
    meta = {"step": 0, "consumed_samples": 0, "model": chunks[0].config.to_dict(), **(metadata or {})}
    CheckpointManager(root, state).save(name, items, metadata=meta)
    return Path(root) / name
