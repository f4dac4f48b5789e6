"""Byte-for-byte agreement with files written by megatron-core's own ``IndexedDatasetBuilder``.

The fixtures under ``fixtures/`` were written by ``fixtures/make_megatron_fixture.py`` with megatron-core (the
version is recorded in each ``.json``); this test needs neither megatron-core nor torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mcore_data import IndexedDataset, IndexedDatasetWriter

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["u16", "i32"])
def test_our_writer_matches_megatron_byte_for_byte(tmp_path: Path, name: str) -> None:
    meta = json.loads((FIXTURES / f"megatron_{name}.json").read_text())
    with IndexedDatasetWriter(tmp_path / name, np.dtype(meta["dtype"])) as w:
        for tokens, lengths in meta["documents"]:
            w.add_document(np.array(tokens, dtype=np.int64), lengths)
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / name).with_suffix(suffix).read_bytes()
        assert ours == (FIXTURES / f"megatron_{name}{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("name", ["u16", "i32"])
def test_megatron_files_read_back(name: str) -> None:
    meta = json.loads((FIXTURES / f"megatron_{name}.json").read_text())
    ds = IndexedDataset(FIXTURES / f"megatron_{name}")
    ds.validate()
    assert ds.dtype == np.dtype(meta["dtype"]) and ds.num_documents == len(meta["documents"])
    for d, (tokens, lengths) in enumerate(meta["documents"]):
        assert ds.document(d).tolist() == tokens
        lo, hi = int(ds.document_indices[d]), int(ds.document_indices[d + 1])
        assert ds.sequence_lengths[lo:hi].tolist() == lengths
