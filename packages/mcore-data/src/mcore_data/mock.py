"""An in-memory stand-in for :class:`~mcore_data.indexed.IndexedDataset`, for tests and dry runs without files."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MockIndexedDataset"]


class MockIndexedDataset:
    """``num_documents`` documents of random tokens (lengths 1..``max_length``, each ending in ``eod``), from a seed."""

    def __init__(
        self, num_documents: int = 1000, max_length: int = 512, vocab_size: int = 1024, seed: int = 0, eod: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.path_prefix = f"mock(documents={num_documents},max_length={max_length},vocab={vocab_size},seed={seed})"
        self.sequence_lengths: npt.NDArray[np.int32] = rng.integers(
            1, max_length + 1, num_documents, dtype=np.int64
        ).astype(np.int32)
        self.document_indices: npt.NDArray[np.int64] = np.arange(num_documents + 1, dtype=np.int64)
        offsets = np.zeros(num_documents + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=offsets[1:])
        self.sequence_pointers = offsets[:-1] * 4
        self.tokens: npt.NDArray[Any] = rng.integers(1, vocab_size, int(offsets[-1]), dtype=np.int64).astype(np.int32)
        self.tokens[offsets[1:] - 1] = eod
        self._offsets = offsets
        self.dtype = self.tokens.dtype

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return len(self)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, i: int) -> npt.NDArray[Any]:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> npt.NDArray[Any]:
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {n}")
        start = int(self._offsets[i]) + offset
        return self.tokens[start : start + length]

    def fingerprint(self) -> dict[str, Any]:
        return {"mock": self.path_prefix}
