"""Structural checks of a Megatron ``.idx`` against its ``.bin``, run every time a dataset is opened.

All checks are vectorised numpy passes over the memory-mapped arrays, chunk by chunk so that memory stays bounded;
100M sequences cost about as much as reading the index once. The first fault raises :class:`IndexFormatError`
naming the file, the entry and the value found, so a corrupt file never loads as silently wrong data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data.errors import IndexFormatError

__all__ = ["check_index"]

_CHUNK = 1 << 22  # entries per vectorised pass


def _check_lengths(idx_path: str, bin_path: str, lengths: npt.NDArray[np.int32], itemsize: int, bin_size: int) -> None:
    """Every length ``>= 0``, and the lengths add up to the ``.bin`` size.

    When they do not, one absurd length (longer than the whole ``.bin`` while the others fit, e.g. INT32_MAX) is
    reported as a fault of that entry; otherwise the ``.bin`` is reported as truncated or too long.
    """
    total = 0
    for lo in range(0, len(lengths), _CHUNK):
        part = lengths[lo : lo + _CHUNK]
        bad = np.flatnonzero(part < 0)
        if bad.size:
            i = lo + int(bad[0])
            raise IndexFormatError(idx_path, f"sequence {i} has length {int(lengths[i])}, which is negative")
        total += int(part.sum(dtype=np.int64))
    max_tokens = bin_size // itemsize
    if total * itemsize == bin_size:
        return
    i = int(np.argmax(lengths)) if len(lengths) else 0
    if len(lengths) and int(lengths[i]) > max_tokens and total - int(lengths[i]) <= max_tokens:
        raise IndexFormatError(
            idx_path, f"sequence {i} has length {int(lengths[i])}, longer than the whole .bin ({max_tokens} tokens)"
        )
    what = "trailing bytes after the last sequence" if bin_size > total * itemsize else "truncated"
    raise IndexFormatError(
        bin_path,
        f"size {bin_size} bytes does not match the index, which ends at byte {total * itemsize} "
        f"(sum of the lengths x {itemsize}): {what}",
    )


def _check_pointers(
    idx_path: str, lengths: npt.NDArray[np.int32], pointers: npt.NDArray[np.int64], itemsize: int
) -> None:
    """``pointer[0] == 0`` and ``pointer[i+1] == pointer[i] + length[i] * itemsize``."""
    carry = 0
    for lo in range(0, len(lengths), _CHUNK):
        nbytes = lengths[lo : lo + _CHUNK].astype(np.int64) * itemsize
        expect = np.empty_like(nbytes)
        expect[0] = carry
        np.cumsum(nbytes[:-1], out=expect[1:])
        expect[1:] += carry
        bad = np.flatnonzero(pointers[lo : lo + _CHUNK] != expect)
        if bad.size:
            i = lo + int(bad[0])
            if i == 0:
                raise IndexFormatError(idx_path, f"sequence 0 has pointer {int(pointers[0])}, expected 0")
            raise IndexFormatError(
                idx_path,
                f"sequence {i} has pointer {int(pointers[i])}, expected {int(expect[i - lo])} (where sequence {i - 1}, "
                f"at byte {int(pointers[i - 1])} with {int(lengths[i - 1])} tokens of {itemsize} bytes, ends)",
            )
        carry = int(expect[-1] + nbytes[-1])


def _check_documents(idx_path: str, docs: npt.NDArray[np.int64], n_seq: int) -> None:
    """Document indices start at 0, never decrease and end at the sequence count."""
    if int(docs[0]) != 0:
        raise IndexFormatError(idx_path, f"document index 0 is {int(docs[0])}, expected 0")
    for lo in range(0, len(docs) - 1, _CHUNK):
        step = np.diff(docs[lo : lo + _CHUNK + 1])
        bad = np.flatnonzero(step < 0)
        if bad.size:
            i = lo + int(bad[0]) + 1
            raise IndexFormatError(
                idx_path,
                f"document index {i} is {int(docs[i])}, less than document index {i - 1} ({int(docs[i - 1])}): "
                "document indices must not decrease",
            )
    if int(docs[-1]) != n_seq:
        raise IndexFormatError(
            idx_path,
            f"document index {len(docs) - 1} (the last) is {int(docs[-1])}, expected the sequence count {n_seq}",
        )


def check_index(
    idx_path: str,
    bin_path: str,
    lengths: npt.NDArray[np.int32],
    pointers: npt.NDArray[np.int64],
    docs: npt.NDArray[np.int64],
    dtype: np.dtype[Any],
    bin_size: int,
) -> None:
    """Raise :class:`IndexFormatError` unless the arrays describe exactly the ``bin_size`` bytes of ``bin_path``."""
    itemsize = dtype.itemsize
    if bin_size % itemsize:
        raise IndexFormatError(bin_path, f"size {bin_size} bytes is not a multiple of the {dtype} item size {itemsize}")
    _check_lengths(idx_path, bin_path, lengths, itemsize, bin_size)
    _check_documents(idx_path, docs, len(lengths))
    _check_pointers(idx_path, lengths, pointers, itemsize)
