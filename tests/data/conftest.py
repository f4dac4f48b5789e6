"""Shared fixtures of the mcore-data tests: small datasets written with the library's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mcore_data import IndexedDatasetWriter


def write_unique_dataset(prefix: Path, lengths: list[int], dtype: type = np.int32) -> None:
    """Documents whose tokens are their global positions in the .bin, so every token is unique."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        pos = 0
        for n in lengths:
            w.add_document(np.arange(pos, pos + n))
            pos += n


@pytest.fixture
def unique_dataset(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    prefix = tmp_path / "uniq"
    write_unique_dataset(prefix, rng.integers(1, 300, 400).tolist())
    return prefix
