"""Reading the safetensors weights of a Hugging Face model directory lazily, one tensor at a time.

Handles a single ``model.safetensors``, shards named by ``model.safetensors.index.json``, or any ``*.safetensors``
files in the directory. Keys saved without the base-model prefix (``h.0.attn...`` instead of
``transformer.h.0.attn...``, as some GPT-2 uploads have) are found too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mcore_export.errors import ExportError, MissingTensorError

__all__ = ["HFTensors"]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PREFIXES = ("transformer.", "model.")


class HFTensors:
    """``get(key)`` returns one tensor of the model; ``meta_get(key)`` its shape and dtype on the meta device."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        index = model_dir / "model.safetensors.index.json"
        self.where: dict[str, Path] = {}
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: model_dir / v for k, v in weight_map.items()}
            missing_files = sorted({str(p.name) for p in self.where.values() if not p.exists()})
            if missing_files:
                raise MissingTensorError(f"{index} names shard files that do not exist: {missing_files}")
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                others = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
                hint = f" (found {others}: re-save the model with safe_serialization=True)" if others else ""
                raise ExportError(f"{model_dir}: no *.safetensors weights{hint}")
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                        self.where[k] = f
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self.used: set[str] = set()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keys(self) -> Iterator[str]:
        return iter(self.where)

    def _resolve(self, key: str) -> str:
        if key in self.where:
            return key
        for p in _PREFIXES:
            if key.startswith(p) and key[len(p) :] in self.where:
                return key[len(p) :]
        raise MissingTensorError(f"{self.dir}: the model has no tensor {key!r}")

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def get(self, key: str) -> torch.Tensor:
        name = self._resolve(key)
        self.used.add(name)
        return self._handle(self.where[name]).get_tensor(name)

    def meta_get(self, key: str) -> torch.Tensor:
        name = self._resolve(key)
        sl = self._handle(self.where[name]).get_slice(name)
        return torch.empty(sl.get_shape(), dtype=_SAFETENSORS_DTYPES[sl.get_dtype()], device="meta")
