"""Reading an mcore checkpoint one global tensor (or one slice of it) at a time.

Every tensor of a checkpoint is a zarr array in its global shape (``docs/checkpoints.md``), whatever TP/PP layout
saved it, so exporters never gather anything: :meth:`CheckpointReader.get` reads one whole tensor and
:meth:`CheckpointReader.region` only the chunks a slice overlaps. A ``meta`` reader returns tensors on the ``meta``
device with the right shape and dtype and reads nothing, which lets exporters plan file layouts (safetensors headers,
shards) and find missing tensors before writing a byte.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mcore_export._llava import is_llava_metadata
from mcore_export.errors import ExportError, MissingTensorError
from mcore_models import TransformerConfig
from mcore_models.checkpoint import model_config_from_checkpoint, resolve_checkpoint, tokenizer_spec_from_checkpoint
from mcore_models.multimodal import LlavaConfig
from mcore_models.multimodal.checkpoint import llava_config_from_checkpoint
from mcore_parallel.checkpoint import read_array_spec, read_metadata, read_region

__all__ = ["CheckpointReader", "resolve_dtype", "DTYPE_NAMES"]

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(name: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of bf16, fp16, fp32") from None


class CheckpointReader:
    """Global tensors of one mcore checkpoint (a checkpoint directory or a run directory with ``latest``).

    A LlavaModel checkpoint is read only with ``llava=True`` (the Hugging Face export; other formats have no
    vision-language model): ``llava`` is its config and ``config`` its language model's."""

    def __init__(self, path: str | Path, meta: bool = False, *, llava: bool = False) -> None:
        self.path = resolve_checkpoint(path)
        self.metadata: dict[str, Any] = read_metadata(self.path)
        self.llava: LlavaConfig | None = None
        if is_llava_metadata(self.metadata.get("model")):
            if not llava:
                raise ExportError(
                    f"{self.path} is a LlavaModel checkpoint (vision tower + language model): only "
                    "`mcore-export hf` exports it (as LlavaForConditionalGeneration)"
                )
            self.llava = llava_config_from_checkpoint(self.path)
            self.config: TransformerConfig = self.llava.language
        else:
            self.config = model_config_from_checkpoint(self.path)
        self.tokenizer: dict[str, Any] | None = tokenizer_spec_from_checkpoint(self.path)
        self.meta = meta
        self.reads = 0  # tensors (or slices) read so far, for logs and tests

    def as_meta(self) -> CheckpointReader:
        """The same checkpoint, returning shape-only tensors."""
        other = object.__new__(CheckpointReader)
        other.__dict__.update(self.__dict__)
        other.meta, other.reads = True, 0
        return other

    def _dir(self, key: str) -> Path:
        array_dir = self.path / "model" / key
        if not (array_dir / "zarr.json").exists():
            raise MissingTensorError(f"{self.path}: the checkpoint has no tensor {key!r} (model/{key}/zarr.json)")
        return array_dir

    def shape(self, key: str) -> tuple[int, ...]:
        return read_array_spec(self._dir(key)).shape

    def dtype(self, key: str) -> torch.dtype:
        return read_array_spec(self._dir(key)).dtype

    def get(self, key: str) -> torch.Tensor:
        """The whole global tensor ``key``."""
        return self.region(key, None)

    def region(self, key: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        """``tensor[region]`` of global tensor ``key``, reading only the chunks it overlaps."""
        array_dir = self._dir(key)
        spec = read_array_spec(array_dir)
        if region is not None:
            region = tuple(region) + tuple(slice(None) for _ in range(len(spec.shape) - len(region)))
            for d, (r, n) in enumerate(zip(region, spec.shape)):
                start, stop = r.start or 0, n if r.stop is None else r.stop
                if not 0 <= start <= stop <= n or r.step not in (None, 1):
                    raise ValueError(f"{key}: region {region} is outside the global shape {spec.shape} (dim {d})")
        if self.meta:
            shape = (
                spec.shape
                if region is None
                else tuple((r.stop if r.stop is not None else n) - (r.start or 0) for r, n in zip(region, spec.shape))
            )
            return torch.empty(shape, dtype=spec.dtype, device="meta")
        self.reads += 1
        return read_region(array_dir, region, spec)
