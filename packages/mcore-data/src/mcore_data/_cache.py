"""The index cache: ``.npy`` arrays next to a JSON description, built once (under a file lock) and reused only
for exactly the same description.

Files are ``{md5}-{Class}-{split}-description.json`` and ``{md5}-{Class}-{split}-{name}.npy``; the md5 is of the
description text. The arrays are written under temporary names and renamed, the description last: a description on
disk means its arrays are complete. A description that differs (another dataset file, seed, length, ...) has another
name, so it is never mistaken for this one; a matching name whose contents differ is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data._files import FileLock, temporary_path

__all__ = ["IndexCache", "description_text"]

logger = logging.getLogger(__name__)


def description_text(description: dict[str, Any]) -> str:
    return json.dumps(description, indent=4)


def _write_npy(f: Any, arr: npt.NDArray[Any], chunk: int = 1 << 22) -> None:
    """``numpy.save`` of a 1-D or 2-D array, copying a strided one in chunks (no full-size temporary)."""
    header = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": arr.shape}
    np.lib.format.write_array_header_1_0(f, header)
    if arr.flags.c_contiguous:
        f.write(np.ascontiguousarray(arr).data)
        return
    for lo in range(0, arr.shape[0], chunk):
        f.write(np.ascontiguousarray(arr[lo : lo + chunk]).tobytes())


class IndexCache:
    """One cached set of arrays in ``directory`` for ``description``."""

    def __init__(self, directory: str | os.PathLike[str], cls: str, split: str, description: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.text = description_text(description)
        self.md5 = hashlib.md5(self.text.encode("utf-8")).hexdigest()
        self.stem = f"{self.md5}-{cls}-{split}"
        self.description_path = self.directory / f"{self.stem}-description.json"

    def path(self, name: str) -> Path:
        return self.directory / f"{self.stem}-{name}.npy"

    def load(self, names: Sequence[str]) -> dict[str, npt.NDArray[Any]] | None:
        """The cached arrays (memory-mapped), or ``None`` when there is no matching complete cache."""
        try:
            text = self.description_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        if text != self.text:
            logger.warning("%s describes another configuration; rebuilding", self.description_path)
            return None
        try:
            return {n: np.load(self.path(n), mmap_mode="r", allow_pickle=False) for n in names}
        except (FileNotFoundError, ValueError) as e:
            logger.warning("incomplete cache %s (%s); rebuilding", self.stem, e)
            return None

    def load_or_build(
        self, names: Sequence[str], build: Callable[[], dict[str, npt.NDArray[Any]]]
    ) -> tuple[dict[str, npt.NDArray[Any]], bool]:
        """Load the arrays, or build and save them once while other processes wait; returns (arrays, built)."""
        found = self.load(names)
        if found is not None:
            return found, False
        with FileLock(self.directory / f".{self.stem}.lock"):
            found = self.load(names)  # another process may have built it while we waited
            if found is not None:
                return found, False
            arrays = build()
            self.save(arrays)
            return arrays, True

    def save(self, arrays: dict[str, npt.NDArray[Any]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, arr in arrays.items():
            tmp = temporary_path(self.path(name))
            with open(tmp, "wb") as f:
                _write_npy(f, arr)
            os.replace(tmp, self.path(name))
        tmp = temporary_path(self.description_path)
        tmp.write_text(self.text, encoding="utf-8")
        os.replace(tmp, self.description_path)
        logger.info("saved index cache %s/%s-*", self.directory, self.stem)
