"""Checking a whole checkpoint offline: every array's metadata, every chunk's presence, size and checksum.

Used by ``mcore-train checkpoint verify`` and ``inspect``; needs no model, no optimizer and no process group.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_parallel.checkpoint.manager import LATEST, latest_checkpoint, read_metadata
from mcore_parallel.checkpoint.zarr_io import ArraySpec, CheckpointFormatError, read_array_spec, read_chunk

__all__ = ["ArrayInfo", "find_arrays", "verify_checkpoint", "verify_path", "checkpoints_in"]


@dataclass(frozen=True)
class ArrayInfo:
    name: str  # path inside the checkpoint, e.g. ``model/embedding.word_embeddings.weight``
    spec: ArraySpec | None  # None when its metadata is missing or bad
    problem: str | None = None


def _node_type(meta_path: Path) -> str | None:
    try:
        node = json.loads(meta_path.read_text()).get("node_type")
    except (OSError, ValueError, AttributeError):
        return "array"  # unreadable: let read_array_spec name the problem
    return node if isinstance(node, str) else None


def find_arrays(ckpt: Path) -> list[ArrayInfo]:
    """Every array under ``model/`` and ``optimizer/``, including ones whose ``zarr.json`` is gone (their chunk
    directory ``c`` is still there) and, for optimizer state, ones missing from some parameters but not others."""
    found: list[ArrayInfo] = []
    for top in ("model", "optimizer"):
        for dirpath, dirnames, filenames in os.walk(ckpt / top):
            here = Path(dirpath)
            name = str(here.relative_to(ckpt))
            if "c" in dirnames or ("c" in filenames and "zarr.json" not in filenames):
                dirnames[:] = [d for d in dirnames if d != "c"]  # chunks, not sub-arrays
                if "zarr.json" not in filenames:
                    found.append(ArrayInfo(name, None, f"{here / 'zarr.json'}: missing (the array's chunks exist)"))
                    continue
            if "zarr.json" in filenames and _node_type(here / "zarr.json") == "array":
                dirnames[:] = []
                try:
                    found.append(ArrayInfo(name, read_array_spec(here)))
                except CheckpointFormatError as e:
                    found.append(ArrayInfo(name, None, str(e)))
    found += _missing_optimizer_states(ckpt, found)
    return sorted(found, key=lambda a: a.name)


def _missing_optimizer_states(ckpt: Path, found: list[ArrayInfo]) -> list[ArrayInfo]:
    by_param: dict[str, set[str]] = {}
    for a in found:
        parts = a.name.split("/")
        if parts[0] == "optimizer" and len(parts) >= 3:
            by_param.setdefault("/".join(parts[1:-1]), set()).add(parts[-1])
    states = set().union(*by_param.values()) if by_param else set()
    return [
        ArrayInfo(f"optimizer/{p}/{s}", None, f"{ckpt / 'optimizer' / p / s}: missing (other parameters have {s!r})")
        for p, have in by_param.items()
        for s in sorted(states - have)
    ]


def _manifest_problems(ckpt: Path, found: set[str]) -> list[str]:
    """The arrays the checkpoint's manifest lists that are not there (none for checkpoints written before it)."""
    path = ckpt / "manifest.json"
    if not path.exists():
        return []
    try:
        listed = json.loads(path.read_text())["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{path}: unreadable manifest ({e})"]
    return [f"{ckpt / name}: missing (listed in {path})" for name in sorted(set(listed) - found)]


def verify_checkpoint(ckpt: Path, checksums: bool = True) -> list[str]:
    """Every problem of one checkpoint directory (empty when it is good): metadata, arrays, each chunk file."""
    problems = []
    try:
        read_metadata(ckpt)
    except CheckpointFormatError as e:
        problems.append(str(e))
    found = find_arrays(ckpt)
    problems += _manifest_problems(ckpt, {a.name for a in found})
    for array in found:
        if array.spec is None:
            problems.append(array.problem or f"{ckpt / array.name}: unreadable")
            continue
        for index in array.spec.chunk_indices():
            try:
                read_chunk(ckpt / array.name, array.spec, index, verify=checksums)
            except CheckpointFormatError as e:
                problems.append(str(e))
    return problems


def checkpoints_in(root: Path) -> list[Path]:
    """The checkpoint directories of a run directory (visible subdirectories with a ``zarr.json`` or ``model/``;
    other directories, such as TensorBoard's, are not checkpoints)."""
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and ((p / "zarr.json").exists() or (p / "model").is_dir())
    )


def verify_path(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Verify a checkpoint directory, or every checkpoint of a run directory and its ``latest`` pointer.

    Returns ``{"checked": [checkpoint dirs], "problems": [...]}``."""
    if not path.is_dir():
        return {"checked": [], "problems": [f"{path}: {'not a directory' if path.exists() else 'does not exist'}"]}
    if (path / "zarr.json").exists() or not (path / LATEST).exists():
        if not (path / "zarr.json").exists() and not (path / "model").exists():
            return {"checked": [], "problems": [f"{path}: not a checkpoint (no zarr.json) nor a run dir (no latest)"]}
        return {"checked": [path], "problems": verify_checkpoint(path, checksums)}
    problems = []
    try:
        latest_checkpoint(path)
    except CheckpointFormatError as e:
        problems.append(str(e))
    checked = checkpoints_in(path)
    for ckpt in checked:
        problems += verify_checkpoint(ckpt, checksums)
    return {"checked": checked, "problems": problems}
