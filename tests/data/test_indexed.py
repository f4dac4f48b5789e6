"""Byte-level format tests of the Megatron .bin/.idx reader and writer."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from mcore_data import IndexedDataset, IndexedDatasetWriter, OutputExistsError, merge_datasets
from mcore_data.indexed import optimal_dtype, write_index


def hand_idx(dtype_code: int, lengths: list[int], doc_idx: list[int], itemsize: int) -> bytes:
    """An .idx packed field by field from the published layout."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    ptr = 0
    for n in lengths:
        out += struct.pack("<q", ptr)
        ptr += n * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


DOCS = [[5, 6, 7], [1], [65000, 2, 3, 4], [9, 9]]


def hand_pair(tmp_path: Path, code: int = 8, fmt: str = "<H", itemsize: int = 2) -> Path:
    prefix = tmp_path / "hand"
    lengths = [len(d) for d in DOCS]
    prefix.with_suffix(".idx").write_bytes(hand_idx(code, lengths, list(range(len(DOCS) + 1)), itemsize))
    prefix.with_suffix(".bin").write_bytes(b"".join(struct.pack(fmt, t) for d in DOCS for t in d))
    return prefix


def test_reads_hand_packed_file(tmp_path: Path) -> None:
    ds = IndexedDataset(hand_pair(tmp_path))
    assert len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 10
    assert ds.dtype == np.uint16
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d
    assert ds[-1].tolist() == DOCS[-1]
    assert ds.get(2, 1, 2).tolist() == [2, 3]
    assert ds.get(2, 2).tolist() == [3, 4]
    assert ds.sequence_pointers.tolist() == [0, 6, 8, 16]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    # zero-copy: views into the mapped .bin
    assert not ds[0].flags.owndata and not ds[0].flags.writeable


def test_reads_int32_header_dtype(tmp_path: Path) -> None:
    ds = IndexedDataset(hand_pair(tmp_path, code=4, fmt="<i", itemsize=4))
    assert ds.dtype == np.int32 and ds[2].tolist() == DOCS[2]


def test_written_files_match_spec_byte_for_byte(tmp_path: Path) -> None:
    ref = hand_pair(tmp_path)
    out = tmp_path / "ours"
    with IndexedDatasetWriter(out, np.uint16) as w:
        w.add_document(DOCS[0])
        w.add_documents(np.array(DOCS[1] + DOCS[2]), [1, 4])
        w.add_document(np.array(DOCS[3], dtype=np.int64))
    assert out.with_suffix(".idx").read_bytes() == ref.with_suffix(".idx").read_bytes()
    assert out.with_suffix(".bin").read_bytes() == ref.with_suffix(".bin").read_bytes()


def test_multi_sequence_documents_and_merge(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with IndexedDatasetWriter(a, np.int32) as w:
        w.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        w.add_document([6])
    with IndexedDatasetWriter(b, np.int32) as w:
        w.add_document([7, 8], lengths=[1, 1])
    ds = IndexedDataset(a)
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.document(0).tolist() == [1, 2, 3, 4, 5]
    m = merge_datasets([a, b], tmp_path / "m")
    assert m.sequence_lengths.tolist() == [2, 3, 1, 1, 1]
    assert m.document_indices.tolist() == [0, 2, 3, 5]
    assert m.tokens.tolist() == list(range(1, 9))
    expect = hand_idx(4, [2, 3, 1, 1, 1], [0, 2, 3, 5], 4)
    assert (tmp_path / "m.idx").read_bytes() == expect
    m.validate()


def test_write_index_only(tmp_path: Path) -> None:
    write_index(tmp_path / "s", np.uint16, [3, 1, 4])
    assert (tmp_path / "s.idx").read_bytes() == hand_idx(8, [3, 1, 4], [0, 1, 2, 3], 2)


def test_optimal_dtype_threshold() -> None:
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(259) == np.uint16


def test_out_of_range_reads(tmp_path: Path) -> None:
    ds = IndexedDataset(hand_pair(tmp_path))
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)
    with pytest.raises(IndexError):
        ds.document(9)


def test_missing_bin(tmp_path: Path) -> None:
    prefix = hand_pair(tmp_path)
    os.remove(prefix.with_suffix(".bin"))
    with pytest.raises(FileNotFoundError, match=r"hand\.bin"):
        IndexedDataset(prefix)


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    prefix = hand_pair(tmp_path)
    before = prefix.with_suffix(".idx").read_bytes()
    with pytest.raises(OutputExistsError, match=r"hand\.bin"):
        IndexedDatasetWriter(prefix)
    assert prefix.with_suffix(".idx").read_bytes() == before
    with IndexedDatasetWriter(prefix, overwrite=True) as w:
        w.add_document([1])
    assert IndexedDataset(prefix)[0].tolist() == [1]


def test_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    prefix = tmp_path / "x"
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    # before finalize nothing under the final names exists either
    w2 = IndexedDatasetWriter(prefix)
    w2.add_document([1])
    assert not prefix.with_suffix(".bin").exists() and not prefix.with_suffix(".idx").exists()
    w2.finalize()
    assert IndexedDataset(prefix)[0].tolist() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.idx"]


def test_token_range_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not fit"), IndexedDatasetWriter(tmp_path / "t", np.uint16) as w:
        w.add_document(np.array([70000]))


def test_empty_dataset(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "e"):
        pass
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
