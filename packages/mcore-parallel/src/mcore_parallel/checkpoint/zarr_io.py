"""Minimal zarr v3 array I/O: regular chunk grid, ``bytes`` codec (little endian, uncompressed) followed by the
standard ``crc32c`` codec (a 4-byte little-endian CRC-32C appended to every chunk), ``/`` chunk keys.

Written by hand rather than through zarr-python so that every rank writes its own chunk files with plain file I/O
(no locks, no metadata round trips) and so that mcore does not need zarr to save or load. The files are standard
zarr v3: fp32/fp16/int arrays open with ``zarr.open_array``; bfloat16 arrays carry the ``bfloat16`` data type name
that tensorstore reads (their chunks are raw little-endian 16-bit words; see ``docs/checkpoints.md`` for reading them
with numpy alone).

Every chunk a read touches must exist and have exactly the size its array's metadata implies; with ``verify`` its
CRC-32C is checked too. Arrays written before the checksum codec (no ``crc32c`` in ``codecs``) still load.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import crc32c
import numpy as np
import torch

from mcore_parallel.errors import MCoreParallelError

__all__ = [
    "ArraySpec",
    "CheckpointFormatError",
    "write_array_metadata",
    "write_chunk",
    "read_array_spec",
    "read_region",
    "chunk_path",
    "read_chunk",
    "check_chunk_file",
]
CRC_BYTES = 4

# torch dtype -> (zarr v3 data type name, numpy dtype used for the raw bytes)
_TORCH_TO_ZARR: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.float32: ("float32", np.dtype("<f4")),
    torch.float64: ("float64", np.dtype("<f8")),
    torch.float16: ("float16", np.dtype("<f2")),
    torch.bfloat16: ("bfloat16", np.dtype("<u2")),
    torch.int64: ("int64", np.dtype("<i8")),
    torch.int32: ("int32", np.dtype("<i4")),
    torch.int16: ("int16", np.dtype("<i2")),
    torch.int8: ("int8", np.dtype("i1")),
    torch.uint8: ("uint8", np.dtype("u1")),
    torch.bool: ("bool", np.dtype("?")),
}
_ZARR_TO_TORCH = {name: dt for dt, (name, _) in _TORCH_TO_ZARR.items()}


class CheckpointFormatError(MCoreParallelError, ValueError):
    """A checkpoint file that is missing, malformed, damaged or of an unsupported layout (names the file).

    ``problems`` lists every problem found (one per file) when several were collected before raising."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems) if problems is not None else [message]
        super().__init__(message)

    @classmethod
    def collected(cls, header: str, problems: list[str]) -> CheckpointFormatError:
        lines = "\n".join(f"  - {p}" for p in problems)
        n = len(problems)
        return cls(f"{header} ({n} problem{'s' if n != 1 else ''}):\n{lines}", problems)


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_shape: tuple[int, ...]
    checksum: bool = True  # chunks end in a CRC-32C (the ``crc32c`` codec)

    @property
    def zarr_dtype(self) -> str:
        return _TORCH_TO_ZARR[self.dtype][0]

    @property
    def np_dtype(self) -> np.dtype:
        return _TORCH_TO_ZARR[self.dtype][1]

    def grid(self) -> tuple[int, ...]:
        return tuple(math.ceil(s / c) if s else 0 for s, c in zip(self.shape, self.chunk_shape))

    def chunk_nbytes(self) -> int:
        """Size of one chunk file: the chunk's bytes plus the checksum."""
        return math.prod(self.chunk_shape) * self.np_dtype.itemsize + (CRC_BYTES if self.checksum else 0)

    def chunk_indices(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(n) for n in self.grid())))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def write_array_metadata(array_dir: Path, spec: ArraySpec, attributes: dict[str, Any] | None = None) -> None:
    if spec.dtype not in _TORCH_TO_ZARR:
        raise CheckpointFormatError(
            f"dtype {spec.dtype} cannot be stored; supported: {sorted(map(str, _TORCH_TO_ZARR))}"
        )
    fill: Any = False if spec.dtype == torch.bool else (0 if not spec.dtype.is_floating_point else 0.0)
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(spec.shape),
        "data_type": spec.zarr_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]
        + ([{"name": "crc32c"}] if spec.checksum else []),
        "attributes": attributes or {},
    }
    array_dir.mkdir(parents=True, exist_ok=True)
    (array_dir / "zarr.json").write_text(json.dumps(meta, indent=1))


def write_group_metadata(group_dir: Path, attributes: dict[str, Any] | None = None) -> None:
    group_dir.mkdir(parents=True, exist_ok=True)
    meta = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    (group_dir / "zarr.json").write_text(json.dumps(meta, indent=1))


def chunk_path(array_dir: Path, index: tuple[int, ...]) -> Path:
    return array_dir.joinpath("c", *map(str, index)) if index else array_dir / "c"


def write_chunk(array_dir: Path, spec: ArraySpec, index: tuple[int, ...], data: torch.Tensor | np.ndarray) -> int:
    """Write one chunk (``data`` may be smaller at the array's edge: it is padded to the chunk shape)."""
    arr = _to_numpy(data) if isinstance(data, torch.Tensor) else data
    if arr.shape != spec.chunk_shape:
        full = np.zeros(spec.chunk_shape, dtype=spec.np_dtype)
        full[tuple(slice(0, n) for n in arr.shape)] = arr
        arr = full
    path = chunk_path(array_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_bytes = np.ascontiguousarray(arr, dtype=spec.np_dtype)
    with open(path, "wb", buffering=0) as f:
        f.write(data_bytes.data)
        if spec.checksum:  # computed once over the bytes just written, no copy
            f.write(crc32c.crc32c(data_bytes.data.cast("B")).to_bytes(CRC_BYTES, "little"))
    return arr.nbytes


def read_array_spec(array_dir: Path) -> ArraySpec:
    meta_path = array_dir / "zarr.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointFormatError(f"{meta_path}: missing (is this array in the checkpoint?)") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{meta_path}: not valid JSON ({e})") from None
    problems = []
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        problems.append("not a zarr v3 array")
    if meta.get("data_type") not in _ZARR_TO_TORCH:
        problems.append(f"unsupported data_type {meta.get('data_type')!r}")
    grid = meta.get("chunk_grid", {})
    if grid.get("name") != "regular":
        problems.append(f"unsupported chunk grid {grid.get('name')!r}")
    codecs = meta.get("codecs", [])
    checksum = len(codecs) == 2 and isinstance(codecs[1], dict) and codecs[1].get("name") == "crc32c"
    if (
        len(codecs) not in (1, 2)
        or (len(codecs) == 2 and not checksum)
        or codecs[0].get("name") != "bytes"
        or codecs[0].get("configuration", {}).get("endian", "little") != "little"
    ):
        problems.append(f"unsupported codecs {codecs} (only uncompressed little-endian bytes, then crc32c)")
    enc = meta.get("chunk_key_encoding", {})
    if enc.get("name") != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
        problems.append(f"unsupported chunk key encoding {enc}")
    if problems:
        raise CheckpointFormatError(f"{meta_path}: " + "; ".join(problems))
    return ArraySpec(
        tuple(meta["shape"]), _ZARR_TO_TORCH[meta["data_type"]], tuple(grid["configuration"]["chunk_shape"]), checksum
    )


def check_chunk_file(path: Path, spec: ArraySpec) -> str | None:
    """The problem with chunk file ``path`` that a stat shows (missing, wrong size), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing chunk (a chunk is never read as the fill value)"
    if size != spec.chunk_nbytes():
        kind = "truncated chunk" if size < spec.chunk_nbytes() else "chunk of the wrong size"
        return f"{path}: {kind} ({size} bytes, expected {spec.chunk_nbytes()})"
    return None


Verify = bool | Literal["sample"]
"""Which chunks' CRC-32C a read checks: every one (True), none (False: presence and sizes only), or ``"sample"``: the
first chunk of every array and one in :data:`SAMPLE_EVERY` of the others (by chunk index, the same on every load)."""
SAMPLE_EVERY = 8


def _checks_crc(verify: Verify, index: tuple[int, ...]) -> bool:
    return verify is True or (verify == "sample" and sum(index) % SAMPLE_EVERY == 0)


def read_chunk(array_dir: Path, spec: ArraySpec, index: tuple[int, ...], verify: Verify = True) -> np.ndarray:
    """One whole chunk, shaped like the chunk; the file must exist, have the right size and (``verify``, see
    :data:`Verify`) checksum."""
    path = chunk_path(array_dir, index)
    expected = spec.chunk_nbytes()
    buf = bytearray(expected + 1)  # one byte more, to notice a file that is too long
    try:
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(buf)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing chunk (a chunk is never read as the fill value)") from None
    if n != expected:
        kind = "truncated chunk" if n < expected else "chunk of the wrong size"
        raise CheckpointFormatError(f"{path}: {kind} ({path.stat().st_size} bytes, expected {expected})")
    view = memoryview(buf)
    data_len = expected - (CRC_BYTES if spec.checksum else 0)
    if spec.checksum and _checks_crc(verify, index):
        stored = int.from_bytes(view[data_len:expected], "little")
        if crc32c.crc32c(view[:data_len]) != stored:
            raise CheckpointFormatError(f"{path}: checksum mismatch (CRC-32C); the chunk is damaged")
    count = math.prod(spec.chunk_shape)
    return np.frombuffer(buf, dtype=spec.np_dtype, count=count).reshape(spec.chunk_shape)


def read_region(
    array_dir: Path, region: tuple[slice, ...] | None = None, spec: ArraySpec | None = None, verify: Verify = True
) -> torch.Tensor:
    """Read ``array[region]`` (whole array by default), touching only the chunks it overlaps.

    Every chunk read must exist and have the right size; with ``verify`` its checksum (when it has one) must match.
    """
    spec = spec or read_array_spec(array_dir)
    region = region or tuple(slice(0, n) for n in spec.shape)
    starts = [r.start or 0 for r in region]
    stops = [spec.shape[d] if r.stop is None else r.stop for d, r in enumerate(region)]
    whole_chunk = all(a % c == 0 and (b - a == c) for a, b, c in zip(starts, stops, spec.chunk_shape))
    if whole_chunk and spec.shape:  # the common case (same layout as the saver): one file, no extra copy
        index = tuple(a // c for a, c in zip(starts, spec.chunk_shape))
        return _to_torch(read_chunk(array_dir, spec, index, verify), spec.dtype)
    rows_only = spec.shape and all(
        a == 0 and b == n and c == n for a, b, c, n in zip(starts[1:], stops[1:], spec.chunk_shape[1:], spec.shape[1:])
    )
    c0 = spec.chunk_shape[0] if spec.shape else 1
    if rows_only and stops[0] > starts[0] and starts[0] // c0 == (stops[0] - 1) // c0:
        # rows of one chunk (e.g. the real rows of a vocabulary-padded piece): a contiguous slice, no extra copy
        index = (starts[0] // c0,) + (0,) * (len(spec.shape) - 1)
        chunk = read_chunk(array_dir, spec, index, verify)
        lo = starts[0] % c0
        return _to_torch(chunk[lo : lo + stops[0] - starts[0]], spec.dtype)
    out = np.empty([b - a for a, b in zip(starts, stops)], dtype=spec.np_dtype)
    ranges = [
        range(a // c, math.ceil(b / c)) if b > a else range(0) for a, b, c in zip(starts, stops, spec.chunk_shape)
    ]
    for index in itertools.product(*ranges):
        chunk = read_chunk(array_dir, spec, index, verify)
        src, dst = [], []
        for d, i in enumerate(index):
            lo, hi = i * spec.chunk_shape[d], (i + 1) * spec.chunk_shape[d]
            a, b = max(lo, starts[d]), min(hi, stops[d])
            src.append(slice(a - lo, b - lo))
            dst.append(slice(a - starts[d], b - starts[d]))
        out[tuple(dst)] = chunk[tuple(src)]
    return _to_torch(out, spec.dtype)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` to disk (before the rename that publishes a checkpoint)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
