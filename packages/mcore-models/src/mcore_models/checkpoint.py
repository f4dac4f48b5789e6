"""Model checkpoints in mcore's sharded zarr format: weights plus the metadata that rebuilds the model.

The full training checkpoint (optimizer state, scheduler, RNG) is mcore-train's; this module is what serving,
export and import need: read a checkpoint's ``TransformerConfig`` and tokenizer description, load weights into a
``GPTModel`` of any TP/PP layout, and write a weights-only checkpoint (e.g. one imported from Hugging Face).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore_models.config import TransformerConfig
from mcore_parallel import ParallelState
from mcore_parallel.checkpoint import CheckpointManager, latest_checkpoint, load_model, read_metadata
from mcore_parallel.checkpoint.zarr_io import CheckpointFormatError

__all__ = [
    "resolve_checkpoint",
    "model_config_from_checkpoint",
    "tokenizer_spec_from_checkpoint",
    "load_weights",
    "save_weights",
]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory whose ``latest`` names one."""
    p = Path(path)
    if (p / "zarr.json").exists() and (p / "model").is_dir():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointFormatError(f"{p} is neither an mcore checkpoint nor a directory with a 'latest' checkpoint")
    return latest


def model_config_from_checkpoint(path: str | Path, keep_backend: bool = False) -> TransformerConfig:
    """The checkpoint's model, with the torch (bf16) layer backend unless ``keep_backend``: the backend is how a run
    trained (``model.fp8``), not what its weights are (every backend has the same parameters), so serving and export
    rebuild a model trained in FP8 with PyTorch's layers."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    if "model" not in meta:
        raise CheckpointFormatError(f"{ckpt}/zarr.json has no 'model' entry: it was not written by mcore-train")
    config = TransformerConfig.from_dict(meta["model"])
    if keep_backend or config.layer_backend == "torch":
        return config
    return config.replace(backend="auto" if config.backend == "auto" else "torch", fp8=None)


def tokenizer_spec_from_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """``{"kind", "path", ...}`` with ``path`` made absolute (relative paths are inside the checkpoint)."""
    ckpt = resolve_checkpoint(path)
    spec = read_metadata(ckpt).get("tokenizer")
    if spec is None:
        return None
    spec = dict(spec)
    if spec.get("path") and not Path(spec["path"]).is_absolute():
        spec["path"] = str(ckpt / spec["path"])
    return spec


def _chunks(models: Any) -> list[Any]:
    return [models] if isinstance(models, torch.nn.Module) else list(models)


def load_weights(models: Any, path: str | Path) -> Path:
    """Load the weights this rank holds (any saving layout) into one model or a list of pipeline chunks (a
    :class:`GPTModel`, or any model with its ``sharded_state_dict()``, such as a LlavaModel)."""
    ckpt = resolve_checkpoint(path)
    for chunk in _chunks(models):
        load_model(ckpt, chunk.sharded_state_dict())
    return ckpt


def save_weights(
    models: Any,
    state: ParallelState,
    root: str | Path,
    name: str = "step_0000000",
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a weights-only checkpoint (collective) with the model config (``chunks[0].config.to_dict()``) in its
    metadata; returns its path. Takes what :func:`load_weights` takes."""
    chunks = _chunks(models)
    items = {}
    for chunk in chunks:
        items.update(chunk.sharded_state_dict())
    meta = {"step": 0, "consumed_samples": 0, "model": chunks[0].config.to_dict(), **(metadata or {})}
    CheckpointManager(root, state).save(name, items, metadata=meta)
    return Path(root) / name
