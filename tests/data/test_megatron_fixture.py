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


@pytest.mark.parametrize("name", ["u16", "i32", "sentences"])
def test_our_writer_matches_megatron_byte_for_byte(tmp_path: Path, name: str) -> None:
    meta = json.loads((FIXTURES / f"megatron_{name}.json").read_text())
    with IndexedDatasetWriter(tmp_path / name, np.dtype(meta["dtype"])) as w:
        for tokens, lengths in meta["documents"]:
            w.add_document(np.array(tokens, dtype=np.int64), lengths)
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / name).with_suffix(suffix).read_bytes()
        assert ours == (FIXTURES / f"megatron_{name}{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("name", ["u16", "i32", "sentences"])
def test_megatron_files_read_back(name: str) -> None:
    meta = json.loads((FIXTURES / f"megatron_{name}.json").read_text())
    ds = IndexedDataset(FIXTURES / f"megatron_{name}")
    ds.validate()
    assert ds.dtype == np.dtype(meta["dtype"]) and ds.num_documents == len(meta["documents"])
    for d, (tokens, lengths) in enumerate(meta["documents"]):
        assert ds.document(d).tolist() == tokens
        lo, hi = int(ds.document_indices[d]), int(ds.document_indices[d + 1])
        assert ds.sequence_lengths[lo:hi].tolist() == lengths


def test_megatron_flags_on_a_sentence_split_corpus_write_megatrons_bytes(tmp_path: Path) -> None:
    """``mcore-data preprocess`` run with Megatron's ``tools/preprocess_data.py`` flags over a corpus whose ``"text"``
    is a list of sentences writes exactly the files megatron-core's builder wrote for the same tokens."""
    from mcore_data.cli import main

    meta = json.loads((FIXTURES / "megatron_sentences.json").read_text())
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in meta["corpus"]))
    out = tmp_path / "out"
    argv = ["preprocess", "--no-progress", "--input", str(src), "--output-prefix", str(out), "--json-keys", "text",
            "--append-eod", "--tokenizer-type", "byte", "--workers", "1"]  # fmt: skip
    assert main(argv) == 0
    for suffix in (".bin", ".idx"):
        ours = tmp_path.joinpath(f"out_text_document{suffix}").read_bytes()
        assert ours == (FIXTURES / f"megatron_sentences{suffix}").read_bytes(), suffix
