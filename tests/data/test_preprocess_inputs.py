"""``mcore-data preprocess`` on awkward inputs: empty and blank-only corpora, whitespace documents, malformed lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mcore_data import EmptyInputError, IndexedDataset, TokenizerSpec
from mcore_data.cli import main
from mcore_data.preprocess import PreprocessConfig, preprocess


def _run(src: Path, out: Path, *extra: str) -> int:
    return main(["preprocess", "--input", str(src), "--output-prefix", str(out), "--no-progress", *extra])


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.jsonl", ""),
        ("blank.jsonl", "\n\n  \n"),
        ("whitespace-texts.jsonl", '{"text": ""}\n{"text": "  \\n\\t"}\n'),
        ("empty.txt", ""),
        ("blank.txt", " \n\t\n"),
    ],
)
def test_empty_or_blank_input_exits_2_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str
) -> None:
    src = tmp_path / name
    src.write_text(content)
    assert _run(src, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "no documents" in err and "--allow-empty" in err and "Traceback" not in err
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.idx").exists()
    assert _run(src, tmp_path / "o", "--allow-empty") == 0
    ds = IndexedDataset(tmp_path / "o")
    assert len(ds) == 0 and ds.num_documents == 0


def test_whitespace_documents_are_blank_unless_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"text": "a"}\n{"text": "   "}\n{"text": ""}\n{"text": "b"}\n')
    assert _run(src, tmp_path / "o") == 0
    assert "documents 2" in capsys.readouterr().out
    ds = IndexedDataset(tmp_path / "o")
    assert [ds[0].tolist(), ds[1].tolist()] == [[97, 256], [98, 256]]  # no lone EOD document
    assert _run(src, tmp_path / "k", "--keep-blank-documents") == 0
    kept = IndexedDataset(tmp_path / "k")
    assert [kept[i].tolist() for i in range(len(kept))] == [[97, 256], [32, 32, 32, 256], [256], [98, 256]]


def test_whitespace_text_file_is_blank(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello")
    (tmp_path / "d" / "b.txt").write_text("  \n\n ")
    cfg = PreprocessConfig(inputs=[str(tmp_path / "d")], output_prefix=str(tmp_path / "o"), tokenizer=TokenizerSpec())
    s = preprocess(cfg)
    assert s.documents == 1 and s.blank == 1


def test_empty_input_raises_in_the_library(tmp_path: Path) -> None:
    src = tmp_path / "e.jsonl"
    src.write_text("")
    with pytest.raises(EmptyInputError, match="no documents"):
        preprocess(PreprocessConfig(inputs=[str(src)], output_prefix=str(tmp_path / "o")))


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_malformed_logs_first_ten_with_file_line_and_total(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int
) -> None:
    src = tmp_path / "bad.jsonl"
    lines = ['{"text": "ok"}'] + ["{broken"] * 15 + ['{"text": "fine"}']
    src.write_text("\n".join(lines) + "\n")
    cfg = PreprocessConfig(inputs=[str(src)], output_prefix=str(tmp_path / "o"), skip_malformed=True, workers=workers)
    with caplog.at_level(logging.WARNING, logger="mcore_data"):
        s = preprocess(cfg)
    assert s.skipped == 15 and s.documents == 2
    logged = [r.getMessage() for r in caplog.records if "skipped malformed line" in r.getMessage()]
    assert len(logged) == 10
    assert logged[0].startswith(f"skipped malformed line {src}:2: ") and f"{src}:11: " in logged[-1]
    assert any("skipped 15 malformed line(s) in total" in r.getMessage() for r in caplog.records)
    assert s.skipped_examples[0].startswith(f"{src}:2: ")
