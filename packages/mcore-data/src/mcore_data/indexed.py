"""Megatron-LM's ``IndexedDataset`` format: a memory-mapped reader and a streaming writer of ``.bin``/``.idx`` pairs.

Layout of ``prefix.idx`` (little-endian, no padding)::

    b"MMIDIDX\\x00\\x00" | u64 version (1) | u8 dtype code | u64 S (sequences) | u64 D (documents + 1)
    int32[S] sequence lengths | int64[S] byte pointers into .bin | int64[D] document indices (0 ... S)
    [int8[S] sequence modes, multimodal datasets only]

``prefix.bin`` is the raw token stream in that dtype, with no header. Files written here are byte-identical to the
ones Megatron-LM writes and reads.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data._files import check_outputs, temporary_path
from mcore_data._validate import check_index
from mcore_data.errors import ConfigError, IndexFormatError

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "INDEX_MAGIC",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "dtype_code",
    "merge_datasets",
    "optimal_dtype",
    "write_index",
]

logger = logging.getLogger(__name__)

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype + 8 S + 8 D
_HEADER = struct.Struct("<9sQBQQ")

#: Megatron's ``DType`` codes.
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
_CHUNK = 1 << 22  # elements per chunk when streaming index arrays


def dtype_code(dtype: npt.DTypeLike) -> int:
    """Megatron's code for ``dtype``; raises :class:`ConfigError` for a dtype the format cannot hold."""
    dt = np.dtype(dtype).newbyteorder("<")
    for code, known in DTYPE_CODES.items():
        if known == dt:
            return code
    raise ConfigError(f"dtype {np.dtype(dtype)} cannot be stored in a Megatron .bin (use one of uint8..int64/uint16)")


def optimal_dtype(vocab_size: int | None) -> np.dtype[Any]:
    """uint16 when the vocabulary is below 65,500 tokens (Megatron's preprocessing rule), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype("<u2")
    return np.dtype("<i4")


def _prefix(path_prefix: str | os.PathLike[str]) -> str:
    p = os.fspath(path_prefix)
    for suffix in (".bin", ".idx"):
        if p.endswith(suffix):
            return p[: -len(suffix)]
    return p


def _map(path: str, size: int, random_access: bool = False) -> mmap.mmap | bytes:
    if size == 0:
        return b""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if random_access and hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)  # samples are read at random: no readahead of megabytes around each one
    return m


def _section(size: int, n_seq: int) -> str:
    """The ``.idx`` array that a file of ``size`` bytes ends inside."""
    if size < HEADER_SIZE + 4 * n_seq:
        return "sequence lengths"
    return "sequence pointers" if size < HEADER_SIZE + 12 * n_seq else "document indices"


class IndexedDataset:
    """A read-only, memory-mapped ``prefix.bin``/``prefix.idx`` pair. Opening checks the index structurally
    (one vectorised O(n) pass, see :mod:`mcore_data._validate`) and raises :class:`IndexFormatError` on any fault.

    ``ds[i]`` is sequence ``i`` as a zero-copy numpy view; ``ds.get(i, offset, length)`` a part of it;
    ``ds.document(i)`` all sequences of document ``i``. The token dtype is taken from the header.

    ``multimodal``: the index ends with one mode byte per sequence (``sequence_modes``), as Megatron's multimodal
    indexes do. The file does not say which it is (Megatron's reader is told too), so a text index with one stray
    byte per sequence is an error here, not a multimodal index.
    """

    def __init__(self, path_prefix: str | os.PathLike[str], multimodal: bool = False) -> None:
        self.path_prefix = _prefix(path_prefix)
        self.idx_path = self.path_prefix + ".idx"
        self.bin_path = self.path_prefix + ".bin"
        for p in (self.idx_path, self.bin_path):
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p}: no such file (expected a Megatron .bin/.idx pair)")
        idx_size = os.path.getsize(self.idx_path)
        if idx_size == 0:
            raise IndexFormatError(self.idx_path, "empty file (0 bytes): not a Megatron MMIDIDX index")
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < len(INDEX_MAGIC) and INDEX_MAGIC.startswith(head):
            raise IndexFormatError(self.idx_path, f"truncated header: {len(head)} of {HEADER_SIZE} bytes")
        if head[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise IndexFormatError(
                self.idx_path, f"bad magic {head[:9]!r}, expected {INDEX_MAGIC!r} (not a Megatron MMIDIDX index)"
            )
        if len(head) < HEADER_SIZE:
            raise IndexFormatError(self.idx_path, f"truncated header: {len(head)} of {HEADER_SIZE} bytes")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != INDEX_VERSION:
            raise IndexFormatError(self.idx_path, f"unknown version {version}, only version 1 is supported")
        if code not in DTYPE_CODES:
            raise IndexFormatError(self.idx_path, f"unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        if n_doc < 1:
            raise IndexFormatError(self.idx_path, "document count is 0; it must be number of documents + 1")
        self.dtype: np.dtype[Any] = DTYPE_CODES[code]
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if idx_size < expected:
            raise IndexFormatError(
                self.idx_path,
                f"truncated index: {idx_size} bytes, header promises {n_seq} sequences and {n_doc - 1} documents "
                f"({expected} bytes); cut inside the {_section(idx_size, n_seq)}",
            )
        extra = idx_size - expected
        if multimodal and extra != n_seq:
            raise IndexFormatError(
                self.idx_path, f"{extra} bytes after the document indices; a multimodal index has one mode byte per "
                f"sequence ({n_seq})"
            )  # fmt: skip
        if not multimodal and extra == n_seq and n_seq > 0:
            raise IndexFormatError(
                self.idx_path, f"{extra} unexpected trailing bytes, one per sequence: if this is a multimodal index "
                "(sequence modes), open it with multimodal=True (mcore-data inspect --multimodal); else it is damaged"
            )  # fmt: skip
        if not multimodal and extra:
            raise IndexFormatError(self.idx_path, f"{extra} unexpected trailing bytes")
        self._idx_buf = _map(self.idx_path, idx_size)
        self.sequence_lengths: npt.NDArray[np.int32] = np.frombuffer(
            self._idx_buf, dtype="<i4", count=n_seq, offset=HEADER_SIZE
        )
        self.sequence_pointers: npt.NDArray[np.int64] = np.frombuffer(
            self._idx_buf, dtype="<i8", count=n_seq, offset=HEADER_SIZE + 4 * n_seq
        )
        self.document_indices: npt.NDArray[np.int64] = np.frombuffer(
            self._idx_buf, dtype="<i8", count=n_doc, offset=HEADER_SIZE + 12 * n_seq
        )
        self.sequence_modes: npt.NDArray[np.int8] | None = None
        if multimodal:
            self.sequence_modes = np.frombuffer(self._idx_buf, dtype=np.int8, count=n_seq, offset=expected)
        bin_size = os.path.getsize(self.bin_path)
        self._check(bin_size)
        self._bin_buf = _map(self.bin_path, bin_size, random_access=True)
        self.tokens: npt.NDArray[Any] = np.frombuffer(self._bin_buf, dtype=self.dtype)

    # -- sizes ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_sequences(self) -> int:
        return len(self)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens in the ``.bin`` (O(1): read from the file size)."""
        return int(self.tokens.shape[0])

    # -- reads ---------------------------------------------------------------------------------------------
    def _start(self, i: int) -> int:
        ptr = int(self.sequence_pointers[i])
        if (
            ptr < 0
            or ptr % self.dtype.itemsize
            or ptr // self.dtype.itemsize + int(self.sequence_lengths[i]) > len(self.tokens)
        ):
            raise IndexFormatError(self.idx_path, f"offsets out of range: sequence {i} points at byte {ptr}")
        return ptr // self.dtype.itemsize

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} ({n} sequences)")
        return i + n if i < 0 else i

    def __getitem__(self, i: int) -> npt.NDArray[Any]:
        i = self._check_index(int(i))
        start = self._start(i)
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> npt.NDArray[Any]:
        """Tokens ``offset : offset + length`` of sequence ``i`` (to its end when ``length`` is None)."""
        i = self._check_index(int(i))
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {n}")
        start = self._start(i) + offset
        return self.tokens[start : start + length]

    def document(self, d: int) -> npt.NDArray[Any]:
        """All tokens of document ``d`` (its sequences are contiguous in the ``.bin``)."""
        nd = self.num_documents
        if not -nd <= d < nd:
            raise IndexError(f"document {d} out of range for {self.path_prefix} ({nd} documents)")
        d = d + nd if d < 0 else d
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if lo == hi:
            return self.tokens[:0]
        start = self._start(lo)
        total = int(self.sequence_lengths[lo:hi].sum(dtype=np.int64))
        return self.tokens[start : start + total]

    def validate(self) -> None:
        """Re-run the structural checks made at open (lengths, pointers, document indices, ``.bin`` size)."""
        self._check(os.path.getsize(self.bin_path))

    def _check(self, bin_size: int) -> None:
        check_index(self.idx_path, self.bin_path, self.sequence_lengths, self.sequence_pointers,
                    self.document_indices, self.dtype, bin_size)  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"dtype={self.dtype})"
        )


def _pack_header(code: int, n_seq: int, n_doc: int) -> bytes:
    return _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, code, n_seq, n_doc)


def _write_idx_arrays(
    f: Any, code: int, n_seq: int, lengths: Iterable[npt.NDArray[Any]], docs: Iterable[npt.NDArray[Any]], n_doc: int
) -> None:
    """Write a whole ``.idx`` streaming: ``lengths`` is iterated twice (lengths, then pointers)."""
    itemsize = DTYPE_CODES[code].itemsize
    f.write(_pack_header(code, n_seq, n_doc))
    chunks = list(lengths) if not isinstance(lengths, _Rereadable) else lengths
    for ln in chunks:
        f.write(np.ascontiguousarray(ln, dtype="<i4").tobytes())
    carry = 0
    for ln in chunks:
        ptr = np.empty(len(ln), dtype="<i8")
        if len(ln):
            ptr[0] = 0
            np.cumsum(np.asarray(ln[:-1], dtype=np.int64) * itemsize, out=ptr[1:])
            ptr += carry
            carry = int(ptr[-1]) + int(ln[-1]) * itemsize
        f.write(ptr.tobytes())
    for d in docs:
        f.write(np.ascontiguousarray(d, dtype="<i8").tobytes())


class _Rereadable:
    """Chunks of a raw int32 file, iterable several times."""

    def __init__(self, path: Path, chunk: int = _CHUNK) -> None:
        self.path, self.chunk = path, chunk

    def __iter__(self) -> Iterator[npt.NDArray[np.int32]]:
        with open(self.path, "rb") as f:
            while True:
                b = f.read(4 * self.chunk)
                if not b:
                    return
                yield np.frombuffer(b, dtype="<i4")


def _raw_chunks(path: Path, dtype: str) -> Iterator[npt.NDArray[Any]]:
    isz = np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        while b := f.read(isz * _CHUNK):
            yield np.frombuffer(b, dtype=dtype)


def write_index(
    path_prefix: str | os.PathLike[str],
    dtype: npt.DTypeLike,
    sequence_lengths: npt.ArrayLike,
    document_indices: npt.ArrayLike | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Write only ``prefix.idx`` from in-memory arrays (e.g. synthetic corpora); one document per sequence by default."""
    idx = Path(_prefix(path_prefix) + ".idx")
    check_outputs([idx], overwrite)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    n = len(lengths)
    docs = np.arange(n + 1, dtype=np.int64) if document_indices is None else np.asarray(document_indices, np.int64)
    tmp = temporary_path(idx)
    try:
        with open(tmp, "wb") as f:
            _write_idx_arrays(
                f,
                dtype_code(dtype),
                n,
                [lengths[i : i + _CHUNK] for i in range(0, n, _CHUNK)],
                (docs[i : i + _CHUNK] for i in range(0, len(docs), _CHUNK)),
                len(docs),
            )
        os.replace(tmp, idx)
    finally:
        if tmp.exists():
            tmp.unlink()


class IndexedDatasetWriter:
    """Streaming writer of a ``prefix.bin``/``prefix.idx`` pair with bounded memory.

    Tokens go straight to a temporary ``.bin``; sequence lengths and document boundaries are spilled to temporary
    side files; :meth:`finalize` writes the ``.idx`` and renames both into place (``.idx`` last), so an interrupted
    write never leaves a pair that looks complete. Use as a context manager: an exception discards everything.
    """

    def __init__(
        self, path_prefix: str | os.PathLike[str], dtype: npt.DTypeLike = np.uint16, *, overwrite: bool = False
    ) -> None:
        self.path_prefix = _prefix(path_prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._code = dtype_code(self.dtype)
        self._bin = Path(self.path_prefix + ".bin")
        self._idx = Path(self.path_prefix + ".idx")
        check_outputs([self._bin, self._idx], overwrite)
        self._bin.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = temporary_path(self._bin)
        self._tmp_idx = temporary_path(self._idx)
        self._tmp_len = temporary_path(self.path_prefix + ".lengths")
        self._tmp_doc = temporary_path(self.path_prefix + ".docs")
        self._fbin = open(self._tmp_bin, "wb", buffering=1 << 22)  # noqa: SIM115 - closed in finalize/abort
        self._flen = open(self._tmp_len, "wb", buffering=1 << 20)  # noqa: SIM115
        self._fdoc = open(self._tmp_doc, "wb", buffering=1 << 20)  # noqa: SIM115
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._done = False

    def _check_range(self, tokens: npt.NDArray[Any]) -> None:
        if self._info is not None and tokens.size and tokens.dtype != self.dtype:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < self._info.min or hi > self._info.max:
                raise ConfigError(f"token ids {lo}..{hi} do not fit {self.dtype}; write with a wider dtype (int32)")

    def add_document(self, tokens: npt.ArrayLike, lengths: Sequence[int] | None = None) -> None:
        """Append one document; ``lengths`` splits it into several sequences (sentences), default one sequence."""
        arr = np.asarray(tokens)
        self._check_range(arr)
        seq = np.asarray([arr.size] if lengths is None else lengths, dtype="<i4")
        if int(seq.sum()) != arr.size:
            raise ConfigError(f"sequence lengths sum to {int(seq.sum())}, but the document has {arr.size} tokens")
        self._fbin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._flen.write(seq.tobytes())
        self.num_sequences += len(seq)
        self.num_documents += 1
        self.num_tokens += arr.size
        self._fdoc.write(np.array([self.num_sequences], dtype="<i8").tobytes())

    def add_documents(
        self, tokens: npt.ArrayLike, lengths: npt.ArrayLike, sequences_per_document: npt.ArrayLike | None = None
    ) -> None:
        """Append many documents at once: ``tokens`` is their concatenation, ``lengths`` their sequences' sizes;
        each document is one sequence unless ``sequences_per_document`` says how many each has."""
        arr = np.asarray(tokens)
        seq = np.asarray(lengths, dtype="<i4")
        self._check_range(arr)
        if int(seq.sum(dtype=np.int64)) != arr.size:
            raise ConfigError(f"lengths sum to {int(seq.sum())}, but {arr.size} tokens were given")
        if sequences_per_document is None:
            ends = np.arange(self.num_sequences + 1, self.num_sequences + len(seq) + 1, dtype="<i8")
        else:
            ends = self.num_sequences + np.cumsum(np.asarray(sequences_per_document, dtype="<i8"))
            if (int(ends[-1]) if len(ends) else self.num_sequences) != self.num_sequences + len(seq):
                raise ConfigError(f"sequences per document do not add up to the {len(seq)} sequences given")
        self._fbin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._flen.write(seq.tobytes())
        self._fdoc.write(ends.astype("<i8").tobytes())
        self.num_sequences += len(seq)
        self.num_documents += len(ends)
        self.num_tokens += arr.size

    def add_index(self, path_prefix: str | os.PathLike[str]) -> None:
        """Append every document of another dataset (same dtype), copying its ``.bin`` bytes."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ConfigError(f"cannot merge {other.path_prefix} ({other.dtype}) into a {self.dtype} dataset")
        with open(other.bin_path, "rb") as src:
            shutil.copyfileobj(src, self._fbin, 1 << 24)
        for lo in range(0, len(other), _CHUNK):
            self._flen.write(np.ascontiguousarray(other.sequence_lengths[lo : lo + _CHUNK]).tobytes())
        for lo in range(1, len(other.document_indices), _CHUNK):
            shifted = other.document_indices[lo : lo + _CHUNK].astype("<i8") + self.num_sequences
            self._fdoc.write(shifted.tobytes())
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        if self._done:
            return
        try:
            for f in (self._fbin, self._flen, self._fdoc):
                f.close()
            with open(self._tmp_idx, "wb", buffering=1 << 22) as f:
                docs = [np.zeros(1, dtype="<i8"), *_raw_chunks(self._tmp_doc, "<i8")]
                _write_idx_arrays(
                    f, self._code, self.num_sequences, _Rereadable(self._tmp_len), docs, self.num_documents + 1
                )
            os.replace(self._tmp_bin, self._bin)
            os.replace(self._tmp_idx, self._idx)
        except BaseException:
            self.abort()
            raise
        finally:
            for p in (self._tmp_len, self._tmp_doc):
                if p.exists():
                    p.unlink()
        self._done = True
        logger.info(
            "wrote %s.{bin,idx}: %d documents, %d tokens", self.path_prefix, self.num_documents, self.num_tokens
        )

    def abort(self) -> None:
        """Discard everything written so far (no output file is left behind)."""
        for f in (self._fbin, self._flen, self._fdoc):
            f.close()
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_len, self._tmp_doc):
            if p.exists():
                p.unlink()
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge_datasets(
    prefixes: Sequence[str | os.PathLike[str]], out_prefix: str | os.PathLike[str], *, overwrite: bool = False
) -> IndexedDataset:
    """Concatenate several datasets (same dtype) into ``out_prefix``; returns the merged dataset."""
    if not prefixes:
        raise ConfigError("merge needs at least one input prefix")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetWriter(out_prefix, first.dtype, overwrite=overwrite) as w:
        for p in prefixes:
            w.add_index(p)
    return IndexedDataset(out_prefix)
