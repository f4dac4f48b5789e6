"""Weights-only LLaVA checkpoints in mcore's sharded format, as :mod:`mcore_models.checkpoint` does for GPT models.

The arrays are :meth:`LlavaModel.sharded_state_dict`'s (``model/vision.*``, ``model/projector.*``,
``model/language.*``), so a checkpoint saved at one TP / PP layout loads at any other, and the metadata's
``"model"`` entry is :meth:`LlavaConfig.to_dict`. A training checkpoint (mcore-train's) holds the same arrays.
"""

from __future__ import annotations

from pathlib import Path

from mcore_models.checkpoint import load_weights, resolve_checkpoint, save_weights
from mcore_models.multimodal.config import LlavaConfig
from mcore_parallel.checkpoint import read_metadata
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


load_llava_weights = load_weights
"""Load a LlavaModel's weights (or its pipeline chunks'): :func:`mcore_models.checkpoint.load_weights`."""
save_llava_weights = save_weights
"""Write a weights-only LlavaModel checkpoint (the LlavaConfig in its metadata):
:func:`mcore_models.checkpoint.save_weights`."""
