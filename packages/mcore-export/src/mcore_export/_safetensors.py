"""A streaming safetensors writer: the header is planned from shapes, then tensors are written one at a time.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; exports of large models must not.
The safetensors format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets,
plus an optional ``__metadata__`` string map), then the raw little-endian tensor bytes back to back. Knowing every
tensor's shape and dtype in advance (exporters get them from a pass over ``meta`` tensors) is enough to write the
header first and stream the data after it. Files written here load with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

__all__ = ["TensorEntry", "SafetensorsWriter", "tensor_nbytes"]

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """Write ``entries`` (in this order) to ``path``; call :meth:`write` once per entry, then :meth:`close`."""

    def __init__(self, path: Path, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for e in entries:
            if e.dtype not in _DTYPE_NAMES:
                raise TypeError(f"{e.name}: dtype {e.dtype} cannot be stored in safetensors")
            if e.name in header:
                raise ValueError(f"{e.name}: listed twice")
            header[e.name] = {
                "dtype": _DTYPE_NAMES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # pad the header with spaces so the data starts 8-byte aligned
        self.path = path
        self._entries = list(entries)
        self._next = 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path}: unexpected tensor {name!r} (all planned tensors are written)")
        e = self._entries[self._next]
        if name != e.name or tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise ValueError(
                f"{self.path}: expected {e.name} {list(e.shape)} {e.dtype}, got {name} {list(tensor.shape)} "
                f"{tensor.dtype} (the write order must follow the plan)"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._entries):
            missing = [e.name for e in self._entries[self._next :]]
            raise ValueError(f"{self.path}: closed before writing {missing}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
