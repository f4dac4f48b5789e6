"""Every structural fault of a ``.bin``/``.idx`` pair is refused at open, naming the file, the entry and the value."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcore_data import IndexedDataset, IndexFormatError
from mcore_data.cli import main

LENGTHS = [3, 1, 4, 2]  # uint16 tokens: pointers 0, 6, 8, 16; .bin is 20 bytes
POINTERS = [0, 6, 8, 16]
DOCS = [0, 1, 2, 3, 4]
INT32_MAX = 2**31 - 1


def pack_idx(
    lengths: list[int] = LENGTHS,
    pointers: list[int] = POINTERS,
    docs: list[int] = DOCS,
    *,
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
    code: int = 8,
) -> bytes:
    """An .idx packed field by field from the published layout, with any field overridden."""
    out = magic + struct.pack("<QBQQ", version, code, len(lengths), len(docs))
    out += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
    return out + struct.pack(f"<{len(docs)}q", *docs)


GOOD_IDX = pack_idx()
GOOD_BIN = bytes(range(20))

# (case id, .idx bytes, .bin bytes, which file is named, words in the message)
CASES: list[tuple[str, bytes, bytes, str, str]] = [
    *[(f"idx-truncated-at-{n}", GOOD_IDX[:n], GOOD_BIN, ".idx", f"truncated header: {n} of 34") for n in (5, 12, 33)],
    ("idx-truncated-at-40", GOOD_IDX[:40], GOOD_BIN, ".idx", "122 bytes); cut inside the sequence lengths"),
    ("idx-truncated-at-60", GOOD_IDX[:60], GOOD_BIN, ".idx", "122 bytes); cut inside the sequence pointers"),
    ("idx-truncated-at-100", GOOD_IDX[:100], GOOD_BIN, ".idx", "122 bytes); cut inside the document indices"),
    ("idx-truncated-at-121", GOOD_IDX[:121], GOOD_BIN, ".idx", "121 bytes, header promises 4 sequences"),
    ("idx-empty", b"", GOOD_BIN, ".idx", "empty file (0 bytes)"),
    (
        "bin-empty",
        GOOD_IDX,
        b"",
        ".bin",
        "size 0 bytes does not match the index, which ends at byte 20 (sum of the lengths x 2): truncated",
    ),
    ("bad-magic", pack_idx(magic=b"NOTANIDX!"), GOOD_BIN, ".idx", "bad magic b'NOTANIDX!'"),
    ("bad-version", pack_idx(version=2), GOOD_BIN, ".idx", "unknown version 2"),
    ("bad-dtype-0", pack_idx(code=0), GOOD_BIN, ".idx", "unknown dtype code 0"),
    ("bad-dtype-9", pack_idx(code=9), GOOD_BIN, ".idx", "unknown dtype code 9"),
    ("negative-length", pack_idx([3, -1, 4, 2]), GOOD_BIN, ".idx", "sequence 1 has length -1, which is negative"),
    (
        "int32-max-length-last",
        pack_idx([3, 1, 4, INT32_MAX]),
        GOOD_BIN,
        ".idx",
        f"sequence 3 has length {INT32_MAX}, longer than the whole .bin",
    ),
    ("int32-max-length-first", pack_idx([INT32_MAX, 1, 4, 2]), GOOD_BIN, ".idx", f"sequence 0 has length {INT32_MAX}"),
    ("shifted-lengths-same-sum", pack_idx([2, 2, 4, 2]), GOOD_BIN, ".idx", "sequence 1 has pointer 6, expected 4"),
    (
        "overlapping-pointers",
        pack_idx(pointers=[0, 4, 8, 16]),
        GOOD_BIN,
        ".idx",
        "sequence 1 has pointer 4, expected 6",
    ),
    ("pointer-past-bin", pack_idx(pointers=[0, 1000, 8, 16]), GOOD_BIN, ".idx", "sequence 1 has pointer 1000"),
    ("first-pointer-not-0", pack_idx(pointers=[2, 8, 10, 18]), GOOD_BIN, ".idx", "sequence 0 has pointer 2"),
    ("docs-not-monotonic", pack_idx(docs=[0, 2, 1, 3, 4]), GOOD_BIN, ".idx", "document index 2 is 1, less than"),
    ("docs-first-not-0", pack_idx(docs=[1, 1, 2, 3, 4]), GOOD_BIN, ".idx", "document index 0 is 1, expected 0"),
    ("docs-last-short", pack_idx(docs=[0, 1, 2, 3, 3]), GOOD_BIN, ".idx", "document index 4 (the last) is 3"),
    ("docs-last-past-end", pack_idx(docs=[0, 1, 2, 3, 5]), GOOD_BIN, ".idx", "(the last) is 5, expected the sequence"),
    ("idx-trailing-3", GOOD_IDX + b"\0" * 3, GOOD_BIN, ".idx", "3 unexpected trailing bytes"),
    ("idx-trailing-20", GOOD_IDX + b"\0" * 20, GOOD_BIN, ".idx", "20 unexpected trailing bytes"),
    (
        "idx-trailing-one-per-sequence",
        GOOD_IDX + b"\0" * 4,
        GOOD_BIN,
        ".idx",
        "4 unexpected trailing bytes, one per sequence: if this is a multimodal index",
    ),
    ("bin-trailing-2", GOOD_IDX, GOOD_BIN + b"\0\0", ".bin", "trailing bytes after the last sequence"),
    ("bin-trailing-1", GOOD_IDX, GOOD_BIN + b"\0", ".bin", "not a multiple of the uint16 item size 2"),
    ("bin-truncated", GOOD_IDX, GOOD_BIN[:-2], ".bin", "size 18 bytes does not match the index, which ends at byte 20"),
    ("no-documents-count", GOOD_IDX[:26] + struct.pack("<Q", 0) + GOOD_IDX[34:], GOOD_BIN, ".idx", "document count"),
]


def _write(tmp_path: Path, idx: bytes, bin_: bytes) -> Path:
    prefix = tmp_path / "bad"
    prefix.with_suffix(".idx").write_bytes(idx)
    prefix.with_suffix(".bin").write_bytes(bin_)
    return prefix


def test_the_untouched_pair_opens(tmp_path: Path) -> None:
    ds = IndexedDataset(_write(tmp_path, GOOD_IDX, GOOD_BIN))
    assert ds.sequence_lengths.tolist() == LENGTHS and ds.num_tokens == 10
    ds.validate()


@pytest.mark.parametrize(("idx", "bin_", "which", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corrupt_pair_is_refused_at_open(tmp_path: Path, idx: bytes, bin_: bytes, which: str, words: str) -> None:
    prefix = _write(tmp_path, idx, bin_)
    with pytest.raises(IndexFormatError) as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(str(prefix) + which + ": ")
    assert words in str(e.value)


@pytest.mark.parametrize(
    ("idx", "bin_", "words"),
    [(c[1], c[2], c[4]) for c in CASES if c[0] in ("negative-length", "shifted-lengths-same-sum", "idx-empty")],
)
def test_inspect_of_a_corrupt_pair_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], idx: bytes, bin_: bytes, words: str
) -> None:
    prefix = _write(tmp_path, idx, bin_)
    assert main(["inspect", str(prefix)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and "Traceback" not in err


def test_a_multimodal_index_opens_when_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One mode byte per sequence after the document indices: read as ``sequence_modes`` with ``multimodal=True``
    (the file cannot tell, as in Megatron), refused otherwise; a text index opened as multimodal is refused too."""
    prefix = _write(tmp_path, GOOD_IDX + bytes([0, 1, 1, 0]), GOOD_BIN)
    ds = IndexedDataset(prefix, multimodal=True)
    assert ds.sequence_modes is not None and ds.sequence_modes.tolist() == [0, 1, 1, 0]
    assert main(["inspect", str(prefix), "--multimodal"]) == 0
    assert main(["inspect", str(prefix)]) == 2
    assert "open it with multimodal=True (mcore-data inspect --multimodal)" in capsys.readouterr().err
    (tmp_path / "text").mkdir()
    text = _write(tmp_path / "text", GOOD_IDX, GOOD_BIN)
    with pytest.raises(IndexFormatError, match="a multimodal index has one mode byte per sequence"):
        IndexedDataset(text, multimodal=True)
    assert IndexedDataset(text).sequence_modes is None


def _synthetic(tmp_path: Path, n: int) -> tuple[Path, Any]:
    """An n-sequence index whose .bin is a sparse file of the right size."""
    from mcore_data.indexed import write_index

    lengths = np.random.default_rng(0).integers(1, 200, n, dtype=np.int32)
    prefix = tmp_path / "big"
    write_index(prefix, np.uint16, lengths)
    with open(prefix.with_suffix(".bin"), "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    return prefix, lengths


def _lines_run_opening(prefix: Path) -> int:
    """How many lines of ``mcore_data``'s Python run while ``IndexedDataset(prefix)`` opens and checks the index."""
    import mcore_data

    root, count = str(Path(mcore_data.__file__).parent), [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        count[0] += event == "line"
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(root) else None

    sys.settrace(tracer)
    try:
        IndexedDataset(prefix)
    finally:
        sys.settrace(None)
    return count[0]


def test_the_checks_of_an_index_run_no_python_loop_over_its_entries(tmp_path: Path) -> None:
    """Opening a 1M-entry index runs exactly the lines a 1,000-entry one does: its checks are array operations,
    so a 10M-entry index opens in a fraction of a second (0.075 s here), where a Python loop over the entries would
    take tens of seconds. Counted, not timed: the count does not depend on the machine's load."""
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    small, _ = _synthetic(tmp_path / "small", 1_000)
    large, _ = _synthetic(tmp_path / "large", 1_000_000)
    assert _lines_run_opening(large) == _lines_run_opening(small) > 0


def test_fault_deep_in_a_large_index_is_found(tmp_path: Path) -> None:
    prefix, _ = _synthetic(tmp_path, 5_000_000)
    raw = bytearray(prefix.with_suffix(".idx").read_bytes())
    i = 4_321_987  # in the second vectorised chunk
    struct.pack_into("<i", raw, 34 + 4 * i, -7)
    prefix.with_suffix(".idx").write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match=f"sequence {i} has length -7"):
        IndexedDataset(prefix)
